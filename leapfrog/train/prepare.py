"""Turn a dataset into a tokenizer folder and two memory-mapped token streams (train, val).

Everything is cached under data_cache/<name>/ keyed by a fingerprint of the data files, the
tokenizer spec and the format version, so a second run (or a resume) tokenises nothing.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from leapfrog.data import corpus as data
from leapfrog.train import couplets
from leapfrog.train.tokenizer import TokenizerSpec, export_hf_tokenizer, train_sentencepiece

FORMAT_VERSION = 1


@dataclass(slots=True)
class Prepared:
    tokenizer_dir: Path
    train: np.memmap
    val: np.memmap
    num_train_items: int
    num_val_items: int
    # Training-only sources mixed into a recipe's windows (TrainConfig.mix), by name.
    extra: dict[str, np.memmap] = field(default_factory=dict)


def _texts(name: str, data_dir: str | None, seed: int, long_repeats: int = 0, truecase: bool = False
           ) -> tuple[list[str], list[str], list[str]]:
    """(train texts, validation texts, tokenizer texts); each text becomes <s> text </s> in the
    stream. The tokenizer is trained on the plain examples, so oversampling long couplets
    (`long_repeats`) changes the stream, never the vocabulary, and so does truecasing the
    lowercased stories (`truecase`): a truecased stage can continue any stories model."""
    items = data.train_items(name, data_dir)
    held = data.heldout(name, data_dir)
    if name == "stories":
        train = data.train_items(name, data_dir, truecase=True)["stories"] if truecase else items["stories"]
        return train, held, items["stories"]
    if truecase:
        raise ValueError(f"truecase applies to the stories data only, not {name!r}")
    base = couplets.build_examples(items["pairs"], items["spring"], seed=seed)
    train = couplets.build_examples(items["pairs"], items["spring"], seed=seed,
                                    long_repeats=long_repeats) if long_repeats else base
    val = [couplets.pair_text(u, d) for u, d in held]
    return train, val, base


def _data_stamp(data_dir: str | None, name: str) -> list[tuple[str, int, int]]:
    folder = data.data_root(data_dir) / name
    return [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in sorted(folder.iterdir())]


def prepare(name: str, spec: TokenizerSpec, data_dir: str | None = None, seed: int = 0,
            max_length: int = 512, long_repeats: int = 0, extra: tuple[str, ...] = (),
            truecase: bool = False) -> Prepared:
    """Build (or reuse) the tokenizer and token streams for dataset ``name``, and a stream for
    each training-only source in ``extra`` (encoded with the same tokenizer)."""
    key_extra = [long_repeats] if long_repeats else []      # existing caches keep their keys
    if truecase:
        key_extra.append("truecase")
    tag = data.fingerprint(FORMAT_VERSION, name, asdict(spec), _data_stamp(data_dir, name), seed, *key_extra)
    root = data.CACHE_DIR / name / tag
    tok_dir, train_bin, val_bin = root / "tokenizer", root / "train.bin", root / "val.bin"
    train_texts, val_texts, tok_texts = _texts(name, data_dir, seed, long_repeats, truecase)
    if not (train_bin.exists() and val_bin.exists() and (tok_dir / "tokenizer.json").exists()):
        # The tokenizer sees training text only, so validation loss is honest.
        sp_model = train_sentencepiece(tok_texts, spec, root / "sentencepiece")
        tok = export_hf_tokenizer(sp_model, tok_dir, spec, max_length, tok_texts[:500])
        encode = lambda texts: [[tok.bos_token_id, *ids, tok.eos_token_id]  # noqa: E731
                                for ids in tok(texts, add_special_tokens=False).input_ids]
        data.write_stream(val_bin, encode(val_texts))
        data.write_stream(train_bin, encode(train_texts))
    streams = {}
    for source in extra:
        path = root / f"extra-{source}.bin"
        if not path.exists():
            # deferred: transformers is heavy and loads only to tokenize extra sources
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(tok_dir)
            texts = data.extra_items(name, source, data_dir)
            data.write_stream(path, [[tok.bos_token_id, *ids, tok.eos_token_id]
                                     for ids in tok(texts, add_special_tokens=False).input_ids])
        streams[source] = data.load_stream(path)
    return Prepared(tok_dir, data.load_stream(train_bin), data.load_stream(val_bin),
                    len(train_texts), len(val_texts), streams)
