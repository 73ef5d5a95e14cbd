"""`leapfrog train <recipe>`: train a built-in model and write its checkpoint folder.

Run as ``python -m leapfrog.train.cli`` until ``leapfrog train`` is wired to ``main``.
"""
from __future__ import annotations

import argparse
import shlex
import sys

from leapfrog.train.recipes import RECIPES


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
    p.add_argument("--out", default=None, help="checkpoint folder to write (default: checkpoints/<recipe>)")
    p.add_argument("--run-dir", default=None, help="resumable state: weights + optimizer (default: runs/<recipe>)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the recipe's)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, default=None, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per training window")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (cosine decay after warm-up)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="autocast precision for training")
    p.add_argument("--save-dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help="dtype of the exported weights")
    p.add_argument("--eval-interval", type=int, default=None, help="steps between validation passes")
    p.add_argument("--ckpt-interval", type=int, default=None, help="steps between resumable saves")
    p.add_argument("--seed", type=int, default=None, help="seed for init and batch order")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads for this process")
    p.add_argument("--resume", action="store_true", help="continue from <run-dir>/state.pt if present")
    p.add_argument("--no-readme", action="store_true",
                   help="skip sampling/metrics after training (README then lacks samples)")
    return p


def _recipe_table() -> str:
    about = {"stories": "English TinyStories continuations",
             "couplets": "Chinese couplets: 上联 -> 下联, and 关键词 -> 上联/下联/横批",
             "stories-moe": "stories as a mixture of experts (Qwen3-MoE, 8 experts, 2 per token)",
             "tiny": "seconds-long smoke test (stories data)",
             "stories-diffusion": "stage 1: stories -> block diffusion (block 4, token shift), "
                                  "written to runs/stories-diffusion/model",
             "stories-diffusion-mb": "stage 2: multi-block (MultiTF) post-training of stage 1, "
                                     "written to runs/stories-diffusion-mb/model",
             "stories-diffusion-distill": "stage 3: stage 2 trained on stories' own continuations "
                                          "(self-distillation)",
             "stories-diffusion-distill2": "stage 4: stage 3 continued; writes checkpoints/stories-diffusion",
             "couplets-continue": "couplets weights moved to the current prompt format",
             "couplets-long": "couplets continued with long 上联 oversampled",
             "couplets-joined": "couplets-long plus synthetic joined long pairs (not shipped)",
             "couplets-deep": "couplets grown 4 -> 6 layers, trained on the couplets-long stream",
             "couplets-mirror": "couplets-long plus swapped long pairs, </s>/punctuation weighted 3x",
             "couplets-weighted": "couplets-long with </s>/punctuation weighted 3x",
             "couplets-rft": "couplets-long plus the model's own right-length 下联 (rejection sampling)",
             "couplets-forced": "couplets-rft with length-forced, punctuation-mirroring candidates",
             "couplets-forced2": "a second round of couplets-forced from its weights, two 下联 kept per 上联",
             "couplets-clean": "couplets-forced without looping candidates",
             "couplets-wide": "couplets-forced on 256-token windows (long pairs learnt whole more often)",
             "couplets-rare": "couplets-forced plus 上联 with out-of-vocabulary (byte-fallback) characters",
             "couplets-rft2": "a second round of couplets-rft from its weights, two 下联 kept per 上联"}
    lines = ["recipes (defaults that the flags override):"]
    for name, make in sorted(RECIPES.items()):
        c = make()
        lines.append(f"  {name:9s} {about.get(name, '')}; hidden {c.model.hidden_size} x "
                     f"{c.model.num_layers} layers, steps {c.max_steps}, batch {c.batch_size} x "
                     f"{c.seq_len}, lr {c.lr}, {c.dtype}, saved as {c.save_dtype}")
    return "\n".join(lines)


OVERRIDES = {"data_dir": "data_dir", "out": "out_dir", "run_dir": "run_dir", "steps": "max_steps",
             "batch_size": "batch_size", "grad_accum": "grad_accum", "seq_len": "seq_len",
             "lr": "lr", "warmup": "warmup_steps", "dtype": "dtype", "save_dtype": "save_dtype",
             "eval_interval": "eval_interval", "ckpt_interval": "ckpt_interval", "seed": "seed",
             "threads": "threads"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "drafter":      # drafters have their own recipe and loop
        from leapfrog.train.drafter import main as drafter_main
        return drafter_main(argv[1:])
    args = build_parser().parse_args(argv)
    cfg = RECIPES[args.recipe]()
    for arg_name, field_name in OVERRIDES.items():
        value = getattr(args, arg_name)
        if value is not None:
            setattr(cfg, field_name, value)
    cfg.lr = max(cfg.lr, cfg.min_lr)
    cfg.command = "leapfrog train " + shlex.join(sys.argv[1:] if argv is None else argv)
    from leapfrog.train.loop import train

    summary = train(cfg, resume=args.resume)
    if not args.no_readme:
        from leapfrog.train.readme import finish_folder

        finish_folder(cfg, summary)
    print(f"wrote {cfg.out_dir}: val loss {summary['val_loss']} after {summary['steps']} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
