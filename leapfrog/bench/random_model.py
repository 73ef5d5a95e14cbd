"""Random-weight Llama checkpoints of a stated size, for measuring decode where it is bound by
reading the weights from memory (weights several times the CPU's last-level cache).

The shape is Llama's at hidden 1024 (16 query heads, 8 KV heads of 64, SwiGLU width 2560), with
as many layers as the size asks; the vocabulary and tokenizer are the built-in `stories` model's,
so prompts are real text. Weights are float16, drawn with transformers' own initialisation from a
fixed seed, and written by transformers: every engine reads the same file.
"""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 1024, 16, 8, 64, 2560
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def parse_size(text: str) -> int:
    """'150m' -> 150_000_000; '1.2b' -> 1_200_000_000."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([mb])", text.strip().lower())
    if not m:
        raise ValueError(f"--size {text!r}: expected a parameter count such as 150m or 1b")
    return int(float(m.group(1)) * (1e6 if m.group(2) == "m" else 1e9))


def shape_for(num_params: int, vocab_size: int) -> dict:
    """A Llama config dict with about `num_params` parameters (untied embeddings)."""
    attn = HIDDEN * HEADS * HEAD_DIM * 2 + HIDDEN * KV_HEADS * HEAD_DIM * 2
    per_layer = attn + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN
    layers = max(1, round((num_params - 2 * vocab_size * HIDDEN) / per_layer))
    return dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                vocab_size=vocab_size, max_position_embeddings=2048, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5)


def random_llama(size: str, tokenizer_from: Path, out: Path, seed: int = 0) -> Path:
    """The checkpoint folder `out/random-<size>`, built once (in a child process, so that the
    benchmark's own process never imports transformers) and reused."""
    # deferred: subprocess loads only when a checkpoint must be built
    import subprocess
    folder = out / f"random-{size.lower()}"
    if not (folder / "model.safetensors").is_file():
        code = ("import sys; from pathlib import Path; from leapfrog.bench.random_model import build; "
                "build(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))")
        subprocess.run([sys.executable, "-c", code, size, str(tokenizer_from), str(folder), str(seed)], check=True)
    return folder


def build(size: str, tokenizer_from: Path, folder: Path, seed: int) -> None:
    # deferred: torch and transformers load only in the child process that builds the model
    import torch
    import transformers
    vocab = transformers.AutoConfig.from_pretrained(tokenizer_from).vocab_size
    cfg = transformers.LlamaConfig(**shape_for(parse_size(size), vocab))
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)


def weight_bytes_per_token(folder: Path, bytes_per_param: int) -> int:
    """Bytes of weights one decode step reads: every matrix once and one row of the input
    embedding (a tied embedding is read once, whole, as the LM head)."""
    # deferred: json and models.info (torch) load only when weight bytes are counted
    import json

    from leapfrog.models.info import param_report
    cfg = json.loads((folder / "config.json").read_text())
    r = param_report(cfg)
    read = r.total if r.tied_embeddings else r.total - r.embedding + cfg["hidden_size"]
    return read * bytes_per_param
