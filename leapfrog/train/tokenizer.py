"""SentencePiece tokenizers for the built-in models, exported as Hugging Face tokenizer folders.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import io
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import sentencepiece as spm


@dataclass(slots=True)
class TokenizerSpec:
    vocab_size: int
    specials: list[str] = field(default_factory=lambda: ["<mask>"])
    # 1 keeps pieces single characters (couplets: one token per 字 makes length easy to count).
    max_piece_length: int = 16
    character_coverage: float = 1.0
    add_dummy_prefix: bool = True
    num_sample_lines: int = 400_000
    # A special token appended to every text encoded with special tokens (see the module doc).
    end_of_prompt: str | None = None
    # False: a character outside the vocabulary encodes as one <unk>, not as its UTF-8 bytes. The
    # vocabulary is trained with the byte pieces all the same (same ids as the byte-fallback
    # tokenizer of this spec); they stay in it as unused pieces (see ``unknown_as_unk``).
    byte_fallback: bool = True


def train_sentencepiece(texts: list[str], spec: TokenizerSpec, out_dir: Path) -> Path:
    """Train a BPE SentencePiece model on texts; returns the path of tokenizer.model."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        model_type="bpe",
        vocab_size=spec.vocab_size,
        hard_vocab_limit=False,  # char-level couplets may have fewer pieces than asked
        byte_fallback=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        user_defined_symbols=spec.specials,
        max_sentencepiece_length=spec.max_piece_length,
        character_coverage=spec.character_coverage,
        # identity: keep newlines and runs of spaces, which stories and prompts rely on.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=spec.add_dummy_prefix,
        split_digits=True,
        max_sentence_length=16384,
        input_sentence_size=spec.num_sample_lines,
        shuffle_input_sentence=True,
        train_extremely_large_corpus=False,
        num_threads=1,
        minloglevel=2,
    )
    path = out_dir / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path


def export_hf_tokenizer(sp_model: Path, out_dir: Path, spec: TokenizerSpec, model_max_length: int,
                        samples: list[str] = ()):
    """Write a folder that AutoTokenizer loads; returns the loaded (fast) tokenizer."""
    # deferred: transformers is heavy and loads only when a tokenizer is exported
    from transformers import AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shutil.copy(sp_model, tmp / "tokenizer.model")
        config = {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>",
            "add_bos_token": True, "add_eos_token": False,
            "legacy": False,
            # SentencePiece was trained with this flag; transformers must prepend "▁" alike.
            "add_prefix_space": spec.add_dummy_prefix,
            "model_max_length": model_max_length,
            "extra_special_tokens": spec.specials,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        tok = AutoTokenizer.from_pretrained(tmp)
        tok.save_pretrained(out_dir)
    shutil.copy(sp_model, out_dir / "tokenizer.model")
    if spec.end_of_prompt:
        mark_end_of_prompt(out_dir, spec.end_of_prompt)
    if not spec.byte_fallback:
        unknown_as_unk(out_dir)
    loaded = AutoTokenizer.from_pretrained(out_dir)
    check_tokenizer(loaded, out_dir / "tokenizer.model", spec.specials, samples, spec.end_of_prompt)
    return loaded


def unknown_as_unk(folder: Path) -> None:
    """Make the folder's tokenizer encode a character outside its vocabulary as one ``<unk>``
    (id 0) instead of its 2-4 UTF-8 byte pieces, in both files: ``tokenizer.model`` (byte
    fallback off, the byte pieces marked UNUSED, which SentencePiece requires of byte pieces
    without byte fallback) and ``tokenizer.json`` (``byte_fallback`` off, ``unk_token`` set,
    ``fuse_unk`` off so that two rare characters in a row stay two tokens). Ids are unchanged.

    Why couplets want it: the model answers position by position, and a rare character it has
    (almost) never seen carries no meaning in its bytes either; as bytes it shifts every later
    position by two or three, and the 下联 came out that much too long."""
    # deferred: sentencepiece's protobuf loads only when the model is edited
    from sentencepiece import sentencepiece_model_pb2 as pb

    folder = Path(folder)
    proto = pb.ModelProto()
    proto.ParseFromString((folder / "tokenizer.model").read_bytes())
    proto.trainer_spec.byte_fallback = False
    for piece in proto.pieces:
        if piece.type == pb.ModelProto.SentencePiece.BYTE:
            piece.type = pb.ModelProto.SentencePiece.UNUSED
    (folder / "tokenizer.model").write_bytes(proto.SerializeToString())
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["model"].update(byte_fallback=False, fuse_unk=False, unk_token="<unk>")
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")


def mark_end_of_prompt(folder: Path, token: str) -> None:
    """Make the folder's tokenizer encode text as ``<s> text token`` (see the module doc)."""
    path = Path(folder) / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    ids = {t["content"]: t["id"] for t in data["added_tokens"]}
    if token not in ids or "<s>" not in ids:
        raise ValueError(f"{path}: {token!r} and <s> must be added tokens")

    def special(name: str, type_id: int) -> dict:
        return {"SpecialToken": {"id": name, "type_id": type_id}}

    def seq(name: str, type_id: int) -> dict:
        return {"Sequence": {"id": name, "type_id": type_id}}

    # A pair reads <s> A token B token; llama.cpp's converter parses this template without
    # warnings (it records add_bos, add_eos and takes the token as the GGUF's eos, </s> as eot).
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [special("<s>", 0), seq("A", 0), special(token, 0)],
        "pair": [special("<s>", 0), seq("A", 0), special(token, 0), seq("B", 1), special(token, 1)],
        "special_tokens": {name: {"id": name, "ids": [ids[name]], "tokens": [name]}
                           for name in ("<s>", token)},
    }
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")
    config_path = Path(folder) / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("add_bos_token", "add_eos_token"):
        config.pop(key, None)
    config_path.write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def check_tokenizer(tok, sp_model: Path, specials: list[str], samples: list[str] = (),
                    end_of_prompt: str | None = None) -> None:
    """The field notes' trap: a tokenizer can load with a 3-token vocabulary. Fail loudly."""
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    if len(tok) != sp.get_piece_size():
        raise RuntimeError(f"HF tokenizer has {len(tok)} tokens, SentencePiece {sp.get_piece_size()}")
    for s in specials:
        if tok.convert_tokens_to_ids(s) != sp.piece_to_id(s):
            raise RuntimeError(f"special {s} has different ids in HF and SentencePiece")
    if (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) != (1, 2, 0):
        raise RuntimeError("expected unk 0, bos 1, eos 2")
    end = [tok.convert_tokens_to_ids(end_of_prompt)] if end_of_prompt else []
    for text in ("春", "hello"):
        plain = tok(text, add_special_tokens=False).input_ids
        if tok(text).input_ids != [1, *plain, *end]:
            raise RuntimeError(f"encoding {text!r} with special tokens gives {tok(text).input_ids}, "
                               f"expected <s> text{' ' + end_of_prompt if end_of_prompt else ''}")
    # The fast tokenizer must split text exactly as SentencePiece did when the caches were built.
    bad = [t for t in samples if tok(t, add_special_tokens=False).input_ids != sp.encode(t)]
    if len(bad) > len(samples) // 100:
        raise RuntimeError(f"HF and SentencePiece disagree on {len(bad)}/{len(samples)} samples")
