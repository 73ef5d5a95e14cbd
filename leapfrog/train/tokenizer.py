"""SentencePiece tokenizers for the built-in models, exported as Hugging Face tokenizer folders.

Layout (same as Llama's): unk 0, bos 1, eos 2, then the special pieces (<mask>, and <sep> for
couplets), then the 256 byte-fallback pieces, then the learned pieces. The folder holds
``tokenizer.model`` + ``tokenizer_config.json`` naming LlamaTokenizer (what llama.cpp's
convert_hf_to_gguf.py reads) and the ``tokenizer.json`` that transformers writes from it.
"""
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
    loaded = AutoTokenizer.from_pretrained(out_dir)
    check_tokenizer(loaded, sp_model, spec.specials, samples)
    return loaded


def check_tokenizer(tok, sp_model: Path, specials: list[str], samples: list[str] = ()) -> None:
    """The field notes' trap: a tokenizer can load with a 3-token vocabulary. Fail loudly."""
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    if len(tok) != sp.get_piece_size():
        raise RuntimeError(f"HF tokenizer has {len(tok)} tokens, SentencePiece {sp.get_piece_size()}")
    for s in specials:
        if tok.convert_tokens_to_ids(s) != sp.piece_to_id(s):
            raise RuntimeError(f"special {s} has different ids in HF and SentencePiece")
    if (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) != (1, 2, 0):
        raise RuntimeError("expected unk 0, bos 1, eos 2")
    # The fast tokenizer must split text exactly as SentencePiece did when the caches were built.
    bad = [t for t in samples if tok(t, add_special_tokens=False).input_ids != sp.encode(t)]
    if len(bad) > len(samples) // 100:
        raise RuntimeError(f"HF and SentencePiece disagree on {len(bad)}/{len(samples)} samples")
