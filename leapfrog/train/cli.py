"""`leapfrog train <recipe>`: train a built-in model and write its checkpoint folder
(``python -m leapfrog.train.cli`` is the same command). `leapfrog train drafter` trains a
drafter (leapfrog.train.drafter). The recipes and their descriptions are in recipes.py."""
from __future__ import annotations

import argparse
import math
import shlex
import sys

from leapfrog.train.loop import train
from leapfrog.train.precision import TRAIN_DTYPES
from leapfrog.train.recipes import RECIPES, describe


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="leapfrog train",
        description="Train a built-in model (tokenizer, Llama weights) from the text in the data "
                    "folder and write a Hugging Face checkpoint folder with README and SHA256SUMS.",
        epilog=_recipe_table() + "\nAn interrupted run continues with --resume (same flags). "
               "Outputs: <out>/ (config.json, model.safetensors, tokenizer files, "
               "generation_config.json, loss.png, training.json, README.md, SHA256SUMS); "
               "<run-dir>/state.pt (weights + AdamW state, every --ckpt-interval steps). "
               "Token caches go to data_cache/.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("recipe", choices=sorted(RECIPES),
                   help="which model to train (`leapfrog train drafter --help` for drafters)")
    p.add_argument("--data-dir", default=None,
                   help="folder holding stories/ and couplets/ (default: ../shared/data next to "
                        "the repository, or $LEAPFROG_DATA_DIR)")
    p.add_argument("--out", default=None, help="checkpoint folder to write (default: the recipe's; for "
                   "stories-large, the recipe folder, beside its base, that gets the delta)")
    p.add_argument("--run-dir", default=None, help="resumable state: weights + optimizer (default: runs/<recipe>)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the recipe's)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, default=None, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per training window")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (cosine decay after warm-up)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps")
    p.add_argument("--dropout", type=float, default=None,
                   help="residual and embedding dropout while training, in [0, 1) (needs the fast forward)")
    p.add_argument("--weight-decay", type=float, default=None, help="AdamW weight decay of the matrices")
    p.add_argument("--unlikelihood", type=float, default=None, metavar="W",
                   help="weight of the token-level unlikelihood term against repeating earlier tokens")
    p.add_argument("--dtype", choices=TRAIN_DTYPES, default=None, help="autocast precision for training")
    p.add_argument("--save-dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help="dtype of the exported weights")
    p.add_argument("--eval-interval", type=int, default=None, help="steps between validation passes")
    p.add_argument("--ckpt-interval", type=int, default=None, help="steps between resumable saves")
    p.add_argument("--seed", type=int, default=None, help="seed for init and batch order")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for this process (default: the recipe's; stories uses every core)")
    p.add_argument("--no-compile", action="store_true",
                   help="run the fast forward uncompiled (no compiler warm-up; slower steps)")
    p.add_argument("--truecase", action="store_true",
                   help="stories: train on the lowercased TinyStories file with its capitals restored "
                        "(the tokenizer stays the same; docs/models.md)")
    p.add_argument("--resume", action="store_true", help="continue from <run-dir>/state.pt if present")
    p.add_argument("--no-readme", action="store_true",
                   help="skip sampling/metrics after training (README then lacks samples)")
    return p


def _recipe_table() -> str:
    lines = ["recipes (defaults that the flags override):"]
    for name, make in sorted(RECIPES.items()):
        c = make()
        lines += [f"  {name}: {describe(name)}",
                  f"      hidden {c.model.hidden_size} x {c.model.num_layers} layers, steps "
                  f"{c.max_steps}, batch {c.batch_size} x {c.seq_len}, lr {c.lr}, {c.dtype}, "
                  f"saved as {c.save_dtype}" + (", fast forward" if c.fast else "")
                  + (" (compiled)" if c.compile else "") + f", {c.threads} thread(s)"]
    return "\n".join(lines) + "\n"


OVERRIDES = {"data_dir": "data_dir", "out": "out_dir", "run_dir": "run_dir", "steps": "max_steps",
             "batch_size": "batch_size", "grad_accum": "grad_accum", "seq_len": "seq_len",
             "lr": "lr", "warmup": "warmup_steps", "dtype": "dtype", "save_dtype": "save_dtype",
             "dropout": "dropout", "weight_decay": "weight_decay",
             "unlikelihood": "unlikelihood",
             "eval_interval": "eval_interval", "ckpt_interval": "ckpt_interval", "seed": "seed",
             "threads": "threads"}


# The flag of each config field, and its least value (a usage error below it, before any work).
LEAST = {"max_steps": ("--steps", 1), "batch_size": ("--batch-size", 1), "grad_accum": ("--grad-accum", 1),
         "seq_len": ("--seq-len", 2), "warmup_steps": ("--warmup", 0), "eval_interval": ("--eval-interval", 1),
         "ckpt_interval": ("--ckpt-interval", 1), "threads": ("--threads", 1)}


# Terms only the fast forward (train.fast) computes: a usage error on a plain-forward recipe.
FAST_ONLY = {"dropout": "dropout", "unlikelihood": "unlikelihood term"}


def _check_numbers(cfg, recipe: str) -> None:
    for field_name, (flag, least) in LEAST.items():
        if getattr(cfg, field_name) < least:
            build_parser().error(f"{flag} {getattr(cfg, field_name)}: must be at least {least}")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        build_parser().error(f"--lr {cfg.lr}: must be a positive number")
    if not 0.0 <= cfg.dropout < 1.0:
        build_parser().error(f"--dropout {cfg.dropout}: must be in [0, 1)")
    for field_name in ("weight_decay", "unlikelihood"):
        value = getattr(cfg, field_name)
        if not (math.isfinite(value) and value >= 0):
            build_parser().error(f"--{field_name.replace('_', '-')} {value}: must be a number >= 0")
    for field_name, what in FAST_ONLY.items():
        if getattr(cfg, field_name) > 0 and not cfg.fast:
            build_parser().error(f"--{field_name}: recipe {recipe} runs the plain forward, which has no {what}")


def config_for(argv: list[str]):
    """(TrainConfig, parsed flags) of `leapfrog train ARGV`: the recipe's config with the flags
    applied."""
    args = build_parser().parse_args(argv)
    cfg = RECIPES[args.recipe]()
    for arg_name, field_name in OVERRIDES.items():
        value = getattr(args, arg_name)
        if value is not None:
            setattr(cfg, field_name, value)
    _check_numbers(cfg, args.recipe)
    if args.no_compile:
        cfg.compile = False
    if args.truecase:
        if cfg.name != "stories":
            build_parser().error(f"--truecase applies to the stories data, not {args.recipe}'s ({cfg.name})")
        cfg.truecase = True
    if cfg.lora is not None and args.out:     # a low-rank run writes into a recipe folder
        cfg.lora.recipe = args.out
    cfg.lr = max(cfg.lr, cfg.min_lr)
    cfg.command = "leapfrog train " + shlex.join(argv)
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "drafter":      # drafters have their own recipe and loop
        # deferred: the drafter trainer loads only for `train drafter`
        from leapfrog.train.drafter import main as drafter_main
        return drafter_main(argv[1:])
    cfg, args = config_for(argv)

    try:
        summary = train(cfg, resume=args.resume)
    except FileNotFoundError as e:        # the data folder, a data file or an init_from folder is not there
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.no_readme and cfg.lora is None:      # a delta's recipe folder keeps its own README
        # deferred: the README writer and its checks load only when a README is written
        from leapfrog.train.readme import finish_folder

        finish_folder(cfg, summary)
    print(f"wrote {cfg.out_dir}: val loss {summary['val_loss']} after {summary['steps']} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
