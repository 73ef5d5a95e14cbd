"""Recipes: the TrainConfig of each built-in model and of each stage of the runs that made the
shipped checkpoints, each sized to train in under an hour on one CPU thread.

Each recipe is described once, by its function's docstring: the first line is the summary that
`leapfrog train --help` lists (``describe``), the rest the details. Every recipe here is a stage
of a shipped checkpoint (its training.json and README name the chain), apart from `tiny`.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Callable

from leapfrog.data.corpus import REPO_ROOT
from leapfrog.train.diffusion import DiffusionSpec
from leapfrog.train.distill import DistillSpec
from leapfrog.train.large import LoraSpec
from leapfrog.train.loop import ModelShape, TrainConfig
from leapfrog.train.tokenizer import TokenizerSpec


def _stories_base() -> TrainConfig:
    """The stories data, tokenizer and shape with the short first schedule (1,200 steps x 2,048
    tokens, one thread): the base that the derived recipes (stories-moe, stories-diffusion's
    stages) set their own schedules on."""
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


def stories() -> TrainConfig:
    """English TinyStories continuations: a 5.5M-parameter Llama, BPE vocabulary 4096, 98M tokens.

    Half the windows come from public-domain children's classics (training only); dropout and weight
    decay counter the repeated data, and the weights of the last eighth are averaged (SWA) as one
    more candidate for the best-validation export. Runs for hours: `--resume` continues the exact
    schedule. Writes runs/stories/model, which the polish stages (`stories-polish` on) finish into
    checkpoints/stories. (docs/models.md, "stories")"""
    cfg = _stories_base()
    cfg.out_dir = str(REPO_ROOT / "runs" / "stories" / "model")
    cfg.batch_size, cfg.max_steps, cfg.warmup_steps = 16, 24000, 500
    cfg.eval_interval, cfg.ckpt_interval, cfg.ckpt_minutes = 500, 500, 5.0
    cfg.mix, cfg.dropout, cfg.keep_best = (("classics", 0.5),), 0.1, True
    cfg.average_from = 0.875
    cfg.fast, cfg.compile, cfg.threads = True, True, os.cpu_count() or 1
    return cfg


def stories_polish() -> TrainConfig:
    """stories stage 2: the long run trained against repeating itself; `stories-unrepeat` finishes it.

    Next-token training alone leaves a small model that, sampled at T = 0.7, loops on its own
    words. 600 more steps x 4,096 tokens (same data, mix and dropout as `stories`) at 1e-4
    cosine to 1e-5, with the token-level unlikelihood term (Welleck et al. 2019) at weight 1:
    at each position, the tokens the window already holds (other than the target) are pushed
    down. The last step's weights are exported (validation reports the cross-entropy alone,
    which the term trades a little of) into runs/stories-polish/model. Needs `leapfrog train
    stories` first."""
    cfg = stories()
    cfg.init_from = cfg.out_dir
    _in_runs(cfg, "stories-polish")
    cfg.max_steps, cfg.warmup_steps, cfg.lr, cfg.min_lr = 600, 10, 1e-4, 1e-5
    cfg.eval_interval, cfg.ckpt_interval = 100, 100
    cfg.keep_best, cfg.compile, cfg.unlikelihood, cfg.average_from = False, False, 1.0, 0.0
    return cfg


def stories_unrepeat() -> TrainConfig:
    """stories stage 3: the unlikelihood term at weight 3 for 200 steps; `stories-context` finishes it.

    Stage 2 left rep-4 at 0.022 on the 116 held-out openings (T = 0.7), above the 0.02 the
    built-in model is held to. 200 more steps x 4,096 tokens, same data, at 5e-5 cosine to 1e-5
    with the term at weight 3 halve it (0.010) and keep coherence (normalised 0.88), for 0.07
    of validation cross-entropy (2.48 -> 2.55): the trade docs/models.md records. Writes
    runs/stories-unrepeat/model. Needs `leapfrog train stories-polish` first."""
    cfg = stories_polish()
    cfg.init_from = cfg.out_dir
    _in_runs(cfg, "stories-unrepeat")
    cfg.max_steps, cfg.warmup_steps, cfg.lr, cfg.min_lr = 200, 10, 5e-5, 1e-5
    cfg.eval_interval, cfg.ckpt_interval, cfg.unlikelihood = 50, 50, 3.0
    return cfg


def stories_context() -> TrainConfig:
    """stories stage 4: the whole 512-token context, on truecased text; writes checkpoints/stories.

    The stages before trained on windows of 256 tokens, so positions 256-511 of the model's 512
    were never trained: on the held-out stories, stage 3's weights lost 3.30 nats a token at
    positions 256-383 and 4.96 at 384-511, against 2.34 at 0-127 (the same tokens read with only
    their last 192 as context: 2.59). 300 more steps x 4,096 tokens, as 8 windows of 512, from
    stage 3's weights at 2e-4 cosine to 1e-5, with the unlikelihood term at weight 1 (stage 2's)
    and the lowercased TinyStories half truecased (`--truecase`, 0.03 nats better in
    docs/models.md's A/B). Needs `leapfrog train stories-unrepeat` first."""
    cfg = stories_polish()
    cfg.recipe, cfg.init_from = "stories-context", stories_unrepeat().out_dir
    cfg.out_dir = str(REPO_ROOT / "checkpoints" / "stories")
    cfg.run_dir = str(REPO_ROOT / "runs" / "stories-context")
    cfg.seq_len, cfg.batch_size = 512, 8
    cfg.max_steps, cfg.lr, cfg.eval_interval, cfg.truecase = 300, 2e-4, 100, True
    return cfg


def stories_large() -> TrainConfig:
    """stories-large trained further: a rank-16 low-rank delta over the grown weights.

    The grown model rebuilt in memory and frozen, with a trainable W + B @ A on every attention and
    MLP projection; B starts as small noise so the grown copies drift apart (leapfrog.train.large).
    The best validation loss's delta is exported into checkpoints/stories-large, whose build.json
    and SHA256SUMS are updated to it. (docs/models.md, "stories-large")"""
    cfg = stories()
    folder = REPO_ROOT / "checkpoints" / "stories-large"
    cfg.recipe, cfg.out_dir, cfg.run_dir = "stories-large", str(folder), str(REPO_ROOT / "runs" / "stories-large")
    cfg.lora = LoraSpec(recipe=str(folder), rank=16)
    cfg.batch_size, cfg.max_steps, cfg.lr, cfg.min_lr, cfg.warmup_steps = 4, 200, 1e-3, 1e-4, 30
    cfg.seq_len, cfg.truecase = 512, True
    cfg.eval_interval, cfg.eval_batches, cfg.ckpt_interval = 50, 8, 25
    cfg.dropout, cfg.compile, cfg.average_from = 0.0, False, 0.0
    return cfg


def stories_moe() -> TrainConfig:
    """stories as a mixture of experts (Qwen3-MoE, 8 experts of width 192, 2 per token), 9.8M tokens.

    Same data, tokenizer spec, seed and classics mix as `stories`, so the validation losses compare;
    the loss includes the router's load-balancing term. transformers' forward (the lean one covers
    dense Llama only); the best validation weights go to checkpoints/stories-moe.
    (docs/models.md, "stories-moe")"""
    cfg = _stories_base()
    cfg.recipe = "stories-moe"
    cfg.out_dir = str(REPO_ROOT / "checkpoints" / "stories-moe")
    cfg.run_dir = str(REPO_ROOT / "runs" / "stories-moe")
    cfg.model = ModelShape(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2,
                           intermediate_size=704, max_position=512, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=192)
    cfg.batch_size, cfg.max_steps, cfg.warmup_steps, cfg.eval_interval = 16, 2400, 100, 200
    cfg.mix, cfg.keep_best, cfg.ckpt_minutes = (("classics", 0.5),), True, 5.0
    cfg.threads = os.cpu_count() or 1
    return cfg


def _in_runs(cfg: TrainConfig, recipe: str) -> None:
    """Name a derived recipe and send its run state and result folder to runs/<recipe>/."""
    cfg.recipe = recipe
    cfg.out_dir = str(REPO_ROOT / "runs" / recipe / "model")
    cfg.run_dir = str(REPO_ROOT / "runs" / recipe)


def couplets() -> TrainConfig:
    """Chinese couplets, 上联 -> 下联 and 关键词 -> 上联/下联/横批: one plain run, 6 layers, 16M tokens.

    One token per character, so a 上联 is as many tokens as characters (no byte fallback: an unknown
    one is <unk>); <sep> ends every prompt and is never generated. Coupled positions: rotary
    positions restart after the first <sep>, so the 下联's j-th character sits at the 上联's j-th
    position, which the export declares in leapfrog.json. The last weights go to checkpoints/couplets.
    (docs/models.md, "couplets")"""
    return TrainConfig(
        name="couplets",
        out_dir=str(REPO_ROOT / "checkpoints" / "couplets"),
        run_dir=str(REPO_ROOT / "runs" / "couplets"),
        model=ModelShape(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2,
                         intermediate_size=704, max_position=256),
        tokenizer=TokenizerSpec(vocab_size=8000, specials=["<mask>", "<sep>"], max_piece_length=1,
                                character_coverage=0.9995, add_dummy_prefix=False,
                                end_of_prompt="<sep>", byte_fallback=False),
        seq_len=128, batch_size=16, max_steps=8000, lr=2e-3, min_lr=1e-4, warmup_steps=300,
        align_to_bos=True, long_repeats=2, rare_chars=10000,
        eval_interval=500, eval_batches=16, ckpt_interval=500, ckpt_minutes=5.0,
        dropout=0.1, keep_best=False, fast=True, compile=True, threads=os.cpu_count() or 1,
        coupled_positions="<sep>",
    )


def stories_diffusion() -> TrainConfig:
    """stories-diffusion stage 1: the stories AR model -> block diffusion (block 4, token shift).

    Block-wise masked diffusion (BD3-LM, Arriola et al. 2025; SDAR; Fast-dLLM v2) from the
    `stories` checkpoint: token shift, since it starts from an AR head, and complementary masks
    (Fast-dLLM v2). Each 256-token window runs as 3 x 256 tokens (two complementary views and
    the clean copy). Writes runs/stories-diffusion/model, stage 2's starting point."""
    cfg = _stories_base()
    return _diffusion_stage(
        cfg, "stories-diffusion", init_from=cfg.out_dir,
        out_dir=REPO_ROOT / "runs" / "stories-diffusion" / "model",
        spec=DiffusionSpec(block_size=4, shift=True, complementary=True),
        max_steps=300, lr=1e-3, min_lr=1e-4, warmup_steps=30)


def stories_diffusion_mb() -> TrainConfig:
    """stories-diffusion stage 2: multi-block (MultiTF) post-training of stage 1.

    MBD-LMs' multi-block teacher forcing: a window runs as [single-block view ; MultiTF view
    (groups of 2-4 blocks) ; clean] with loss 0.5 single + 0.5 multi, the same 3 x 256 tokens per
    window as stage 1 (the single-block view drops its complement to pay for the MultiTF view).
    Needs `leapfrog train stories-diffusion` first; writes runs/stories-diffusion-mb/model,
    stage 3's starting point."""
    return _diffusion_stage(
        _stories_base(), "stories-diffusion-mb", init_from=stories_diffusion().out_dir,
        out_dir=REPO_ROOT / "runs" / "stories-diffusion-mb" / "model",
        spec=DiffusionSpec(block_size=4, shift=True, complementary=False, multi_views=1,
                           multi_weight=0.5, max_group=4),
        max_steps=300, lr=5e-4, min_lr=5e-5, warmup_steps=20)


def stories_diffusion_distill() -> TrainConfig:
    """stories-diffusion stage 3: stage 2 trained on the stories model's own continuations.

    Self-distillation (dParallel; CLLM, Kou et al. 2024): the training stream is the `stories`
    AR model's continuations of 4,000 training-story openings (two thirds greedy, one third
    T=0.7 / top-p 0.9; ``leapfrog.train.distill``), with stage 2's objective (0.5 single-block +
    0.5 MultiTF). Text the parent wrote is more predictable than the corpus, so the diffusion
    model's confidences rise and parallel unmasking commits more tokens per forward. The
    regenerated stream is cached. Writes runs/stories-diffusion-distill/model, stage 4's
    starting point."""
    cfg = _diffusion_stage(
        _stories_base(), "stories-diffusion-distill", init_from=stories_diffusion_mb().out_dir,
        out_dir=REPO_ROOT / "runs" / "stories-diffusion-distill" / "model",
        spec=DiffusionSpec(block_size=4, shift=True, complementary=False, multi_views=1,
                           multi_weight=0.5, max_group=4),
        max_steps=800, lr=5e-4, min_lr=5e-5, warmup_steps=30)
    cfg.distill = DistillSpec(parent=stories_context().out_dir)       # the shipped stories
    return cfg


def stories_diffusion_distill2() -> TrainConfig:
    """stories-diffusion stage 4: stage 3 continued; writes checkpoints/stories-diffusion-plain.

    1,200 more steps on the same distilled stream (cached) at a lower learning rate (3e-4
    cosine to 3e-5), since stage 3 ended with the training loss still falling."""
    cfg = stories_diffusion_distill()
    cfg.recipe, cfg.init_from = "stories-diffusion-distill2", cfg.out_dir
    cfg.out_dir = str(REPO_ROOT / "checkpoints" / "stories-diffusion-plain")
    cfg.run_dir = str(REPO_ROOT / "runs" / "stories-diffusion-distill2")
    cfg.max_steps, cfg.lr, cfg.min_lr, cfg.warmup_steps = 1200, 3e-4, 3e-5, 30
    return cfg


def stories_diffusion_stream() -> TrainConfig:
    """stories-diffusion stage 5: the two-stream model; writes checkpoints/stories-diffusion.

    `stories` itself, frozen, for every known token (causal attention, so decoding at threshold
    1.0 is exactly `stories`), plus a mask stream (train.mask_stream) for the mask tokens: stage
    4's layers, final norm and mask embedding, trained with stage 3's objective (0.5 single-block
    + 0.5 MultiTF on `stories`' own continuations) against the frozen parent's keys and values."""
    cfg = stories_diffusion_distill()
    cfg.recipe, cfg.init_from = "stories-diffusion-stream", stories_context().out_dir
    cfg.mask_stream_from = stories_diffusion_distill2().out_dir
    cfg.diffusion = DiffusionSpec(block_size=4, shift=True, complementary=False, multi_views=1,
                                  multi_weight=0.5, max_group=4, mask_stream=True)
    cfg.out_dir = str(REPO_ROOT / "checkpoints" / "stories-diffusion")
    cfg.run_dir = str(REPO_ROOT / "runs" / "stories-diffusion-stream")
    cfg.max_steps, cfg.lr, cfg.min_lr, cfg.warmup_steps = 1000, 3e-4, 3e-5, 30
    cfg.keep_best = True
    return cfg


CLOVER_EXPERTS = (32, 2, 0.01)      # experts, per token, the copies' noise: about a tenth active


def stories_clover() -> TrainConfig:
    """stories-clover stage 1: stories-moe grown to 32 experts, 2 per token, then block diffusion.

    Sparse upcycling: each of stories-moe's 8 experts copied 4 times (the copies and their router
    rows perturbed by 1%), then stories-diffusion's stage 1 objective. Writes
    runs/stories-clover/model (docs/models.md, "stories-clover")."""
    cfg = _diffusion_stage(
        _stories_base(), "stories-clover", init_from=stories_moe().out_dir,
        out_dir=REPO_ROOT / "runs" / "stories-clover" / "model",
        spec=DiffusionSpec(block_size=4, shift=True, complementary=True),
        max_steps=300, lr=1e-3, min_lr=1e-4, warmup_steps=30)
    cfg.grow_experts = CLOVER_EXPERTS
    return cfg


def _grown_shape(cfg: TrainConfig) -> TrainConfig:
    """The shape stage 1 grew (CLOVER_EXPERTS experts of stories-moe's width), which the later
    stages read from their starting folder: stated here so that the recipe is the config that ran."""
    moe = stories_moe().model
    cfg.model.num_experts, cfg.model.num_experts_per_tok = CLOVER_EXPERTS[0], CLOVER_EXPERTS[1]
    cfg.model.moe_intermediate_size = moe.moe_intermediate_size
    return cfg


def stories_clover_mb() -> TrainConfig:
    """stories-clover stage 2: multi-block (MultiTF) post-training of stage 1, as stories-diffusion-mb."""
    cfg = _grown_shape(stories_diffusion_mb())
    cfg.recipe, cfg.init_from = "stories-clover-mb", stories_clover().out_dir
    cfg.out_dir = str(REPO_ROOT / "runs" / "stories-clover-mb" / "model")
    cfg.run_dir = str(REPO_ROOT / "runs" / "stories-clover-mb")
    return cfg


def stories_clover_distill() -> TrainConfig:
    """stories-clover stage 3: stage 2 on its AR parent's (stories-moe's) own continuations,
    single-block and MultiTF; writes runs/stories-clover-distill/model, the start of the greedy
    stages."""
    cfg = _grown_shape(stories_diffusion_distill())
    cfg.recipe, cfg.init_from = "stories-clover-distill", stories_clover_mb().out_dir
    cfg.distill = DistillSpec(parent=stories_moe().out_dir)
    cfg.out_dir = str(REPO_ROOT / "runs" / "stories-clover-distill" / "model")
    cfg.run_dir = str(REPO_ROOT / "runs" / "stories-clover-distill")
    cfg.max_steps = 1200
    return cfg



def stories_clover_distill2() -> TrainConfig:
    """stories-clover, tried after stage 3: stage 3 continued on the same cached stream at a lower
    learning rate (3e-4 cosine to 3e-5), as stories-diffusion's stage 4; writes
    runs/stories-clover-distill2/model (tried, not shipped: docs/models.md)."""
    cfg = stories_clover_distill()
    cfg.recipe, cfg.init_from = "stories-clover-distill2", cfg.out_dir
    cfg.out_dir = str(REPO_ROOT / "runs" / "stories-clover-distill2" / "model")
    cfg.run_dir = str(REPO_ROOT / "runs" / "stories-clover-distill2")
    cfg.max_steps, cfg.lr, cfg.min_lr, cfg.warmup_steps = 1200, 3e-4, 3e-5, 30
    return cfg


def stories_clover_greedy() -> TrainConfig:
    """stories-clover stage 4, on greedy text: stage 3 continued on its AR parent's greedy
    continuations only (no sampled third), at 3e-4 cosine to 3e-5.

    The bench decodes greedily and judges against the parent's greedy text; a sampled
    continuation teaches the model to spread its probability where the parent's greedy choice
    is certain, which keeps confidences under a high threshold. Writes
    runs/stories-clover-greedy/model."""
    cfg = stories_clover_distill()
    cfg.recipe, cfg.init_from = "stories-clover-greedy", cfg.out_dir
    cfg.distill = DistillSpec(parent=stories_moe().out_dir, sampled_every=0)
    cfg.out_dir = str(REPO_ROOT / "runs" / "stories-clover-greedy" / "model")
    cfg.run_dir = str(REPO_ROOT / "runs" / "stories-clover-greedy")
    cfg.max_steps, cfg.lr, cfg.min_lr, cfg.warmup_steps = 1000, 3e-4, 3e-5, 30
    return cfg


def stories_clover_greedy_mb() -> TrainConfig:
    """stories-clover stage 5: stage 4 (greedy text) with more weight on the multi-block view.

    0.75 of the loss on MultiTF (later blocks behind a masked one) instead of 0.5, on the same
    cached greedy stream, at a lower learning rate: multi-block decoding commits a later block's
    tokens only where the model is confident behind the unfinished block before it. Writes
    runs/stories-clover-greedy-mb/model, which export_llada2 turns into the shipped LLaDA2-MoE
    folder (`python -m leapfrog.train.clover`)."""
    cfg = stories_clover_greedy()
    cfg.recipe, cfg.init_from = "stories-clover-greedy-mb", cfg.out_dir
    cfg.diffusion = replace(cfg.diffusion, multi_weight=0.75)
    cfg.out_dir = str(REPO_ROOT / "runs" / "stories-clover-greedy-mb" / "model")
    cfg.run_dir = str(REPO_ROOT / "runs" / "stories-clover-greedy-mb")
    cfg.max_steps, cfg.lr, cfg.min_lr, cfg.warmup_steps = 600, 2e-4, 2e-5, 20
    return cfg


def stories_clover_greedy_mb2() -> TrainConfig:
    """stories-clover, tried after stage 5: the same stage with 0.9 of the loss on MultiTF.

    Stage 5 raised single-block and multi-block tokens a forward alike; this asks whether a
    heavier multi-block weight moves multi-block ahead of single-block (it did not: not
    shipped, docs/benchmarks.md). Writes runs/stories-clover-greedy-mb2/model."""
    cfg = stories_clover_greedy_mb()
    cfg.recipe, cfg.init_from = "stories-clover-greedy-mb2", stories_clover_greedy().out_dir
    cfg.diffusion = replace(cfg.diffusion, multi_weight=0.9)
    cfg.out_dir = str(REPO_ROOT / "runs" / "stories-clover-greedy-mb2" / "model")
    cfg.run_dir = str(REPO_ROOT / "runs" / "stories-clover-greedy-mb2")
    return cfg


def _diffusion_stage(base: TrainConfig, recipe: str, init_from: str | Path, out_dir: Path,
                     spec: DiffusionSpec, **schedule) -> TrainConfig:
    """A block-diffusion run over the stories data: same dataset, tokenizer spec and seed as
    `stories` (so the token streams match the initial model's tokenizer), windows starting at a
    story's <s> (so the block grid is the one decoding uses), shape taken from `init_from`."""
    base.recipe, base.init_from, base.diffusion = recipe, str(init_from), spec
    base.out_dir, base.run_dir = str(out_dir), str(REPO_ROOT / "runs" / recipe)
    base.seq_len, base.batch_size, base.align_to_bos = 256, 4, True
    base.eval_interval, base.eval_batches, base.ckpt_interval = 75, 4, 25
    for key, value in schedule.items():
        setattr(base, key, value)
    return base


def tiny(name: str = "stories", out_dir: str | Path = "runs/tiny/out",
         run_dir: str | Path = "runs/tiny/run") -> TrainConfig:
    """A seconds-long smoke test (stories data by default) for tests and trying the pipeline."""
    return TrainConfig(
        name=name, out_dir=str(out_dir), run_dir=str(run_dir),
        model=ModelShape(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                         intermediate_size=64, max_position=64),
        tokenizer=TokenizerSpec(vocab_size=512 if name == "stories" else 8000,
                                specials=["<mask>"] if name == "stories" else ["<mask>", "<sep>"],
                                max_piece_length=16 if name == "stories" else 1,
                                add_dummy_prefix=name == "stories",
                                end_of_prompt=None if name == "stories" else "<sep>"),
        seq_len=32, batch_size=4, max_steps=10, lr=3e-3, min_lr=3e-4, warmup_steps=2,
        eval_interval=5, eval_batches=2, ckpt_interval=5,
    )


RECIPES: dict[str, Callable[[], TrainConfig]] = {
    "stories": stories, "stories-polish": stories_polish, "stories-unrepeat": stories_unrepeat,
    "stories-context": stories_context, "stories-moe": stories_moe, "stories-large": stories_large, "tiny": tiny,
    "couplets": couplets,
    "stories-diffusion": stories_diffusion, "stories-diffusion-mb": stories_diffusion_mb,
    "stories-diffusion-distill": stories_diffusion_distill,
    "stories-diffusion-distill2": stories_diffusion_distill2,
    "stories-diffusion-stream": stories_diffusion_stream,
    "stories-clover": stories_clover, "stories-clover-mb": stories_clover_mb,
    "stories-clover-distill": stories_clover_distill, "stories-clover-distill2": stories_clover_distill2,
    "stories-clover-greedy": stories_clover_greedy, "stories-clover-greedy-mb": stories_clover_greedy_mb,
    "stories-clover-greedy-mb2": stories_clover_greedy_mb2,
}


# Recipes whose shipped weights are being retrained by a longer recipe of the same name: the
# recipe that trained the weights in checkpoints/ now, as it was (commit 303a7b1). An entry goes
# when the retrained weights ship.
SHIPPED_BY: dict[str, Callable[[], TrainConfig]] = {}


def describe(name: str) -> str:
    """A recipe's one-line summary: the first line of its function's docstring."""
    return (RECIPES[name].__doc__ or "").strip().splitlines()[0].rstrip(".")
