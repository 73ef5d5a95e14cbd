"""Recipes: the TrainConfig of each built-in model, sized for ~40 minutes on one CPU thread."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from leapfrog.train.data import REPO_ROOT
from leapfrog.train.loop import ModelShape, TrainConfig
from leapfrog.train.tokenizer import TokenizerSpec


def stories() -> TrainConfig:
    """English TinyStories-style continuations: a 5.5M-parameter Llama, BPE vocabulary 4096."""
    return TrainConfig(
        name="stories",
        out_dir=str(REPO_ROOT / "checkpoints" / "stories"),
        run_dir=str(REPO_ROOT / "runs" / "stories"),
        model=ModelShape(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2,
                         intermediate_size=704, max_position=512),
        tokenizer=TokenizerSpec(vocab_size=4096, specials=["<mask>"]),
        seq_len=256, batch_size=8, max_steps=1200, lr=2e-3, min_lr=1e-4, warmup_steps=100,
        eval_interval=250, eval_batches=16, ckpt_interval=50,
    )


def couplets() -> TrainConfig:
    """Chinese couplets: one token per character (max piece length 1), <sep> between the sides."""
    return TrainConfig(
        name="couplets",
        out_dir=str(REPO_ROOT / "checkpoints" / "couplets"),
        run_dir=str(REPO_ROOT / "runs" / "couplets"),
        model=ModelShape(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                         intermediate_size=704, max_position=256),
        tokenizer=TokenizerSpec(vocab_size=8000, specials=["<mask>", "<sep>"], max_piece_length=1,
                                character_coverage=0.9995, add_dummy_prefix=False),
        seq_len=128, batch_size=16, max_steps=3600, lr=2e-3, min_lr=1e-4, warmup_steps=100,
        align_to_bos=True,
        eval_interval=250, eval_batches=16, ckpt_interval=50,
    )


def tiny(name: str = "stories", out_dir: str | Path = "runs/tiny/out",
         run_dir: str | Path = "runs/tiny/run") -> TrainConfig:
    """A seconds-long smoke recipe for tests and trying the pipeline."""
    return TrainConfig(
        name=name, out_dir=str(out_dir), run_dir=str(run_dir),
        model=ModelShape(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                         intermediate_size=64, max_position=64),
        tokenizer=TokenizerSpec(vocab_size=512 if name == "stories" else 8000,
                                specials=["<mask>"] if name == "stories" else ["<mask>", "<sep>"],
                                max_piece_length=16 if name == "stories" else 1,
                                add_dummy_prefix=name == "stories"),
        seq_len=32, batch_size=4, max_steps=10, lr=3e-3, min_lr=3e-4, warmup_steps=2,
        eval_interval=5, eval_batches=2, ckpt_interval=5,
    )


RECIPES: dict[str, Callable[[], TrainConfig]] = {"stories": stories, "couplets": couplets, "tiny": tiny}
