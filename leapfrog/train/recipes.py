"""Recipes: the TrainConfig of each built-in model, sized for ~40 minutes on one CPU thread (the
block-diffusion stages for ~15 minutes each)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from leapfrog.data.corpus import REPO_ROOT
from leapfrog.train.diffusion import DiffusionSpec
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


def stories_moe() -> TrainConfig:
    """`stories` as a mixture of experts: a Qwen3-MoE whose every MLP is 8 SwiGLU experts of width
    192, 2 per token (9.3M parameters, 4.0M active per token, against the dense model's 5.5M).
    Same data, tokenizer spec and seed as `stories`, hence the same tokenizer and token streams
    and a comparable validation loss. The training loss includes the router's load-balancing term
    (0.01 x ~2). ~2 s per step of 8 x 256 tokens on one thread: 600 steps, ~20 minutes."""
    cfg = stories()
    cfg.recipe = "stories-moe"
    cfg.out_dir = str(REPO_ROOT / "checkpoints" / "stories-moe")
    cfg.run_dir = str(REPO_ROOT / "runs" / "stories-moe")
    cfg.model = ModelShape(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2,
                           intermediate_size=704, max_position=512, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=192)
    cfg.max_steps, cfg.warmup_steps, cfg.eval_interval = 600, 60, 100
    return cfg


def _in_runs(cfg: TrainConfig, recipe: str) -> None:
    """Name a derived recipe and send its run state and result folder to runs/<recipe>/."""
    cfg.recipe = recipe
    cfg.out_dir = str(REPO_ROOT / "runs" / recipe / "model")
    cfg.run_dir = str(REPO_ROOT / "runs" / recipe)


def couplets() -> TrainConfig:
    """Chinese couplets: one token per character (max piece length 1), <sep> between the sides;
    the tokenizer ends every encoded prompt with <sep> (leapfrog.train.couplets)."""
    return TrainConfig(
        name="couplets",
        out_dir=str(REPO_ROOT / "checkpoints" / "couplets"),
        run_dir=str(REPO_ROOT / "runs" / "couplets"),
        model=ModelShape(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                         intermediate_size=704, max_position=256),
        tokenizer=TokenizerSpec(vocab_size=8000, specials=["<mask>", "<sep>"], max_piece_length=1,
                                character_coverage=0.9995, add_dummy_prefix=False,
                                end_of_prompt="<sep>"),
        seq_len=128, batch_size=16, max_steps=3600, lr=2e-3, min_lr=1e-4, warmup_steps=100,
        align_to_bos=True,
        eval_interval=250, eval_batches=16, ckpt_interval=50,
    )


def couplets_continue() -> TrainConfig:
    """Continue `couplets` weights on the current data format at a modest learning rate: how the
    shipped model moved to prompts that end in <sep> (its first 3,600 steps had the model emit
    <sep> itself). Starts from runs/couplets-continue/init, the earlier weights cut to the current
    tokenizer by ``leapfrog.train.couplets.trim_vocab``; same data, tokenizer spec and seed as
    `couplets`. Writes runs/couplets-continue/model, copied over checkpoints/couplets once measured."""
    cfg = couplets()
    cfg.recipe = "couplets-continue"
    cfg.init_from = str(REPO_ROOT / "runs" / "couplets-continue" / "init")
    cfg.out_dir = str(REPO_ROOT / "runs" / "couplets-continue" / "model")
    cfg.run_dir = str(REPO_ROOT / "runs" / "couplets-continue")
    cfg.max_steps, cfg.lr, cfg.min_lr, cfg.warmup_steps = 2200, 5e-4, 5e-5, 50
    return cfg


def couplets_long() -> TrainConfig:
    """Continue the shipped `couplets` weights with pairs whose 上联 has 8+ characters seen 3x
    as often (2 extra copies): the model matches the 上联's length for 99% of short 上联 but
    loses count on long ones. Same tokenizer (trained on the plain examples), data and seed as
    `couplets`; writes runs/couplets-long/model, copied over checkpoints/couplets once measured."""
    cfg = couplets()
    cfg.recipe = "couplets-long"
    cfg.init_from = str(REPO_ROOT / "checkpoints" / "couplets")
    cfg.out_dir = str(REPO_ROOT / "runs" / "couplets-long" / "model")
    cfg.run_dir = str(REPO_ROOT / "runs" / "couplets-long")
    cfg.max_steps, cfg.lr, cfg.min_lr, cfg.warmup_steps = 1400, 3e-4, 3e-5, 50
    cfg.long_repeats = 2
    return cfg


def couplets_joined() -> TrainConfig:
    """Continue the shipped `couplets` weights (couplets-long) on the couplets-long stream plus
    20,000 synthetic long pairs: 2-3 training pairs joined clause by clause with "，"
    (``leapfrog.train.couplets.join_pairs``), so the model practises keeping count at 16-48
    characters. Same tokenizer, data and seed as `couplets`; writes runs/couplets-joined/model,
    copied over checkpoints/couplets once measured."""
    cfg = couplets_long()
    _in_runs(cfg, "couplets-joined")
    cfg.joined_pairs = 20000
    return cfg


def couplets_mirror() -> TrainConfig:
    """Continue the shipped `couplets` weights on the couplets-long stream plus every long pair
    once more with its sides swapped, and with the targets that fix a side's length (</s> and
    punctuation) weighted 3x in the loss (``length_weight`` 2): the two ways left to make length
    the thing the model gets right. Writes runs/couplets-mirror/model, copied over
    checkpoints/couplets once measured."""
    cfg = couplets_long()
    _in_runs(cfg, "couplets-mirror")
    cfg.mirror_long, cfg.length_weight = 1, 2.0
    return cfg


def couplets_weighted() -> TrainConfig:
    """`couplets-mirror` without the swapped pairs: the couplets-long stream with </s> and
    punctuation targets weighted 3x, to tell the two changes apart."""
    cfg = couplets_mirror()
    _in_runs(cfg, "couplets-weighted")
    cfg.mirror_long = 0
    return cfg


def couplets_rft() -> TrainConfig:
    """Continue the shipped `couplets` weights on the couplets-long stream plus the model's own
    right-length 下联 for every training 上联 of 12+ characters (4 candidates at T=0.8, one
    distinct right-length one kept: rejection-sampling fine-tuning on the length rule, see
    ``leapfrog.train.distill.rejection_sampled``). Writes runs/couplets-rft/model, copied over
    checkpoints/couplets once measured."""
    from leapfrog.train.distill import RejectionSpec

    cfg = couplets_long()
    _in_runs(cfg, "couplets-rft")
    cfg.rejection = RejectionSpec(parent=str(REPO_ROOT / "checkpoints" / "couplets"))
    cfg.max_steps, cfg.lr, cfg.min_lr, cfg.warmup_steps = 1000, 2e-4, 2e-5, 50
    return cfg


def couplets_rft2() -> TrainConfig:
    """A second round of `couplets-rft` from the shipped (round-one) weights: candidates by
    that model, up to two distinct right-length ones kept per 上联. Writes
    runs/couplets-rft2/model, copied over checkpoints/couplets once measured."""
    cfg = couplets_rft()
    _in_runs(cfg, "couplets-rft2")
    cfg.rejection.keep = 2
    return cfg


def couplets_forced() -> TrainConfig:
    """`couplets-rft` with length-forced candidates: for every training 上联 of 8+ characters two
    samples (T=0.8) by the shipped model with end-of-text banned until the 上联's length and the
    下联 cut there; one whose punctuation mirrors the 上联's is kept. Unlike rejection sampling this
    covers the 上联 the model never gets right on its own. Writes runs/couplets-forced/model,
    copied over checkpoints/couplets once measured."""
    cfg = couplets_rft()
    _in_runs(cfg, "couplets-forced")
    cfg.rejection.min_chars, cfg.rejection.samples, cfg.rejection.force_length = 8, 2, True
    return cfg


def couplets_clean() -> TrainConfig:
    """`couplets-forced` without the candidates that loop (a 3-character run repeated more often
    than in the 上联): cut at the 上联's length, a looping 下联 keeps the right length and
    punctuation but teaches the loop. Writes runs/couplets-clean/model, copied over
    checkpoints/couplets once measured."""
    cfg = couplets_forced()
    _in_runs(cfg, "couplets-clean")
    cfg.rejection.no_loops = True
    return cfg


def couplets_wide() -> TrainConfig:
    """`couplets-forced` on 256-token windows (8 per step: the same tokens per step). Windows
    start at a random <s>, and an example is learnt whole (its </s>, where the length is decided)
    only in windows that hold all of it: at 128 tokens a pair of 70-90 tokens (a 上联 of 34-44
    characters) is whole in half as many windows as a short pair, at 256 in 0.76x as many.
    Writes runs/couplets-wide/model, copied over checkpoints/couplets once measured."""
    cfg = couplets_forced()
    _in_runs(cfg, "couplets-wide")
    cfg.seq_len, cfg.batch_size = 256, 8
    return cfg


def couplets_forced2() -> TrainConfig:
    """A second round of `couplets-forced` from its weights (runs/couplets-forced/model): the
    candidates come from that model, two distinct ones kept per 上联. Writes
    runs/couplets-forced2/model, copied over checkpoints/couplets once measured."""
    cfg = couplets_forced()
    _in_runs(cfg, "couplets-forced2")
    cfg.init_from = cfg.rejection.parent = str(REPO_ROOT / "runs" / "couplets-forced" / "model")
    cfg.rejection.keep = 2
    return cfg


def couplets_rare() -> TrainConfig:
    """`couplets-forced` plus 20,000 pairs whose 上联 carries 1-2 characters outside the
    vocabulary (``leapfrog.train.couplets.rare_char_pairs``): a rare character reaches the model
    as three byte tokens, and it answered with a 下联 as long as the byte count. Starts from the
    shipped weights; writes runs/couplets-rare/model, copied over checkpoints/couplets once
    measured."""
    cfg = couplets_forced()
    _in_runs(cfg, "couplets-rare")
    cfg.rare_chars = 20000
    return cfg


def couplets_unk() -> TrainConfig:
    """`couplets-rare` with the rare characters as one token each: the tokenizer encodes a
    character outside the vocabulary as a single <unk> instead of its UTF-8 bytes
    (``TokenizerSpec.byte_fallback`` False; same vocabulary and ids), so a 上联 with such a
    character is as many tokens as characters, and 10,000 pairs with 1-2 <unk> in the 上联 teach
    the model to answer one 下联 character for it. Otherwise as `couplets-forced` (from the shipped
    weights, length-forced candidates, 1,000 steps). Writes runs/couplets-unk/model, copied over
    checkpoints/couplets once measured."""
    cfg = couplets_forced()
    _in_runs(cfg, "couplets-unk")
    cfg.tokenizer = replace(cfg.tokenizer, byte_fallback=False)
    cfg.rare_chars = 10000
    return cfg


def couplets_swa() -> TrainConfig:
    """`couplets-unk` exporting the mean of the weights after each of its last 500 steps
    (``TrainConfig.average_from``): the fine-tunes above land ±1% apart in length match from
    run to run, and the average over the cosine tail is one way to take that noise out. Same
    data and trajectory as `couplets-unk`; writes runs/couplets-swa/model. Measured 2026-12-01:
    94.6% length match on all 821 held-out 上联 (777; the shipped model 768), 94.0% on the
    check's 300, exact McNemar p = 0.25 against the shipped weights: not shipped."""
    cfg = couplets_unk()
    _in_runs(cfg, "couplets-swa")
    cfg.average_from = 0.5
    return cfg


def couplets_deep() -> TrainConfig:
    """The shipped 4-layer `couplets` grown to 6 layers (a zero-output copy after layers 1 and 3,
    ``leapfrog.train.grow``: same logits at step 0) and trained on the couplets-long stream (pairs
    with 8+ character 上联 seen 3x): more depth for keeping count on long 上联. 3,000 steps,
    ~1.5 s each on one thread. Writes runs/couplets-deep/model, copied over checkpoints/couplets
    once measured."""
    cfg = couplets_long()
    _in_runs(cfg, "couplets-deep")
    cfg.grow_layers = 2
    cfg.max_steps, cfg.lr, cfg.min_lr, cfg.warmup_steps = 3000, 5e-4, 3e-5, 100
    return cfg


def stories_diffusion() -> TrainConfig:
    """Stage 1: the `stories` AR model -> a block-diffusion model (block 4, token shift, since it
    starts from an AR head; complementary masks). Its result stays in runs/ as the single-block
    baseline and is stage 2's starting point; the shipped `stories-diffusion` is stage 2's.

    Cost: each 256-token window runs as 3 x 256 tokens (two complementary views + the clean copy),
    2.7 s per step of 4 windows on one quiet thread (~380 window tokens/s; 4-5 s while another
    job shares the CPU): 300 steps, ~14 min plus ~1 min of validation and the README check."""
    cfg = stories()
    return _diffusion_stage(
        cfg, "stories-diffusion", init_from=cfg.out_dir,
        out_dir=REPO_ROOT / "runs" / "stories-diffusion" / "model",
        spec=DiffusionSpec(block_size=4, shift=True, complementary=True),
        max_steps=300, lr=1e-3, min_lr=1e-4, warmup_steps=30)


def stories_diffusion_mb() -> TrainConfig:
    """Stage 2: multi-block post-training (MBD-LMs MultiTF) of stage 1's model, written to
    runs/stories-diffusion-mb/model (stage 3's starting point). A window runs as [single-block
    view ; MultiTF view (groups of 2-4 blocks) ; clean] with loss 0.5 single + 0.5 multi: the same 3 x 256 tokens per window as
    stage 1 (the single-block view drops its complement to pay for the MultiTF view), so the same
    ~15 min for 300 steps. Run `leapfrog train stories-diffusion` first."""
    return _diffusion_stage(
        stories(), "stories-diffusion-mb", init_from=stories_diffusion().out_dir,
        out_dir=REPO_ROOT / "runs" / "stories-diffusion-mb" / "model",
        spec=DiffusionSpec(block_size=4, shift=True, complementary=False, multi_views=1,
                           multi_weight=0.5, max_group=4),
        max_steps=300, lr=5e-4, min_lr=5e-5, warmup_steps=20)


def stories_diffusion_distill() -> TrainConfig:
    """Stage 3: the shipped multi-block model (stage 2) fine-tuned on the `stories` AR model's own
    continuations of 4,000 training-story openings (two thirds greedy, one third T=0.7 / top-p
    0.9; ``leapfrog.train.distill``) with stage 2's objective (0.5 single-block + 0.5 MultiTF).
    Text the parent wrote is far more predictable than the corpus, so the diffusion model's
    confidences rise and parallel unmasking commits more tokens per forward. Regenerating takes
    a few minutes (cached); 800 steps ~27 min on one thread. Writes runs/stories-diffusion-distill
    /model (stage 4's starting point)."""
    from leapfrog.train.distill import DistillSpec

    cfg = _diffusion_stage(
        stories(), "stories-diffusion-distill", init_from=stories_diffusion_mb().out_dir,
        out_dir=REPO_ROOT / "runs" / "stories-diffusion-distill" / "model",
        spec=DiffusionSpec(block_size=4, shift=True, complementary=False, multi_views=1,
                           multi_weight=0.5, max_group=4),
        max_steps=800, lr=5e-4, min_lr=5e-5, warmup_steps=30)
    cfg.distill = DistillSpec(parent=stories().out_dir)
    return cfg


def stories_diffusion_distill2() -> TrainConfig:
    """Stage 4: stage 3 continued for 1,200 more steps on the same distilled stream (cached) at a
    lower learning rate (3e-4 cosine to 3e-5): stage 3 ended with the training loss still
    falling. ~38 min on one thread. Writes the shipped checkpoints/stories-diffusion."""
    cfg = stories_diffusion_distill()
    cfg.recipe, cfg.init_from = "stories-diffusion-distill2", cfg.out_dir
    cfg.out_dir = str(REPO_ROOT / "checkpoints" / "stories-diffusion")
    cfg.run_dir = str(REPO_ROOT / "runs" / "stories-diffusion-distill2")
    cfg.max_steps, cfg.lr, cfg.min_lr, cfg.warmup_steps = 1200, 3e-4, 3e-5, 30
    return cfg


def stories_diffusion_distill3() -> TrainConfig:
    """Stage 5 (experimental): stage 4 trained 1,200 more steps on a fresh distilled stream
    (seed 1235: another 4,000 openings) with more weight on the multi-block views (0.3 single +
    0.7 MultiTF), aiming at multi-block decoding's tokens per forward. Writes
    runs/stories-diffusion-distill3/model."""
    cfg = stories_diffusion_distill2()
    cfg.recipe, cfg.init_from = "stories-diffusion-distill3", cfg.out_dir
    cfg.out_dir = str(REPO_ROOT / "runs" / "stories-diffusion-distill3" / "model")
    cfg.run_dir = str(REPO_ROOT / "runs" / "stories-diffusion-distill3")
    cfg.seed = 1235
    cfg.diffusion.multi_weight = 0.7
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
    """A seconds-long smoke recipe for tests and trying the pipeline."""
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
    "stories": stories, "stories-moe": stories_moe, "couplets": couplets, "tiny": tiny,
    "couplets-continue": couplets_continue, "couplets-long": couplets_long,
    "couplets-joined": couplets_joined, "couplets-deep": couplets_deep,
    "couplets-mirror": couplets_mirror, "couplets-weighted": couplets_weighted,
    "couplets-rft": couplets_rft, "couplets-rft2": couplets_rft2,
    "couplets-forced": couplets_forced, "couplets-rare": couplets_rare, "couplets-unk": couplets_unk,
    "couplets-swa": couplets_swa,
    "couplets-forced2": couplets_forced2, "couplets-wide": couplets_wide,
    "couplets-clean": couplets_clean,
    "stories-diffusion-distill": stories_diffusion_distill,
    "stories-diffusion-distill2": stories_diffusion_distill2,
    "stories-diffusion-distill3": stories_diffusion_distill3,
    "stories-diffusion": stories_diffusion, "stories-diffusion-mb": stories_diffusion_mb,
}
