"""`leapfrog bench --suite train`: the training loop's speed, old against new, on one recipe.

Every variant trains ``--recipe`` (dropout off) from the same weights on the same batches, each
in its own process, for ``--train-steps`` timed steps after ``--warm-steps`` untimed ones (which
include compilation). Variants:

  hf-1t               transformers' forward, AdamW unfused, one thread (the loop before this suite)
  hf                  the same on ``--threads`` threads
  fast                train.fast's forward and fused AdamW, ``--threads``
  fast-compiled       the same, the step compiled by torch.compile (the recipe's setting)
  fast-compiled-bf16  the same under bfloat16 autocast (float32 master weights)

Reported: tokens/s and the ratio to ``hf-1t``; the warm-up's seconds; matrix-multiply FLOP/s
(per token, 6 x the parameters that multiply + 6 x layers x width x window for attention); and
each variant's loss curve against ``hf-1t``'s, which must agree up to float rounding.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path



def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def load_average() -> float:
    return os.getloadavg()[0]

VARIANTS = {
    "hf-1t": dict(fast=False, compile=False, dtype="fp32", threads=1),
    "hf": dict(fast=False, compile=False, dtype="fp32"),
    "fast": dict(fast=True, compile=False, dtype="fp32"),
    "fast-compiled": dict(fast=True, compile=True, dtype="fp32"),
    "fast-compiled-bf16": dict(fast=True, compile=True, dtype="bf16"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leapfrog bench --suite train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=["train"], default="train")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                   help="threads of every variant but hf-1t")
    p.add_argument("--out", default="bench_results", help="folder for JSON, markdown and PNG")
    p.add_argument("--recipe", default="stories", help="train: the recipe whose data and shape are trained")
    p.add_argument("--train-steps", type=int, default=12, help="train: timed optimizer steps per variant")
    p.add_argument("--warm-steps", type=int, default=3, help="train: untimed steps first (compilation)")
    p.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS),
                   help="train: which loops to time (default all; the bfloat16 one only on a CPU "
                        "with native bfloat16, since emulated it runs at a few percent of float32)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (out / "train.md").write_text(table + "\n")
    plot(result, out / "train.png")
    print(table)
    log(f"wrote {out}/train.json, .md, .png")
    return 0


def _worker(spec: dict) -> dict:
    """One variant in this process: ``spec`` holds the recipe, the variant's settings, the step
    counts and a scratch folder."""
    # deferred: torch and the trainer load only in the worker process
    import torch

    from leapfrog.train import loop
    from leapfrog.train.recipes import RECIPES

    cfg = RECIPES[spec["recipe"]]()
    cfg.fast, cfg.compile, cfg.dtype = spec["fast"], spec["compile"], spec["dtype"]
    cfg.threads, cfg.dropout, cfg.keep_best = spec["threads"], 0.0, False
    cfg.run_dir = cfg.out_dir = spec["scratch"]
    cfg.eval_interval = cfg.ckpt_interval = 10**9
    cfg.ckpt_minutes = 0.0
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    prep = loop.training_data(cfg)
    model, tok = loop._model_and_tokenizer(cfg, prep)
    opt = loop.make_optimizer(model, cfg)
    objective = loop.make_objective(cfg, tok, model)
    history = {"train": [], "val": [], "val_parts": [], "wall_s": 0.0, "tokens": 0}
    total = spec["warm_steps"] + spec["train_steps"]
    cfg.max_steps = spec["warm_steps"]
    t0 = time.perf_counter()
    step, history = loop._run_steps(model, opt, prep, cfg, 0, history, Path(cfg.run_dir), objective)
    warm_s = time.perf_counter() - t0
    wall0, tokens0 = history["wall_s"], history["tokens"]
    cfg.max_steps = total
    step, history = loop._run_steps(model, opt, prep, cfg, step, history, Path(cfg.run_dir), objective)
    c = model.config
    matmul_params = sum(p.numel() for n, p in model.named_parameters()
                        if p.dim() == 2 and "embed_tokens" not in n)
    if c.tie_word_embeddings:
        matmul_params += model.lm_head.weight.numel()
    flops_per_token = 6 * matmul_params + 6 * c.num_hidden_layers * c.hidden_size * cfg.seq_len
    tok_s = (history["tokens"] - tokens0) / (history["wall_s"] - wall0)
    return {"tok_s": tok_s, "warm_s": warm_s, "losses": [loss for _, loss in history["train"]],
            "gflop_s": tok_s * flops_per_token / 1e9, "params": sum(p.numel() for p in model.parameters()),
            "tokens_per_step": cfg.batch_size * cfg.seq_len * cfg.grad_accum, "threads": cfg.threads}


def _clean_env(threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))}
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def run(args) -> dict:
    rows = []
    if args.variants is None:
        args.variants = [v for v in VARIANTS if "bf16" not in v or _bf16_hardware()]
    with tempfile.TemporaryDirectory(prefix="leapfrog-bench-train-") as scratch:
        for name in args.variants:
            v = VARIANTS[name]
            spec = {"recipe": args.recipe, "fast": v["fast"], "compile": v["compile"], "dtype": v["dtype"],
                    "threads": v.get("threads", args.threads), "warm_steps": args.warm_steps,
                    "train_steps": args.train_steps, "scratch": str(Path(scratch) / name)}
            log(f"train: {name} ({spec['threads']} thread(s)), {args.warm_steps} + {args.train_steps} steps")
            out = Path(scratch) / f"{name}.json"
            code = ("import json, sys; from leapfrog.train.speed import _worker; "
                    "json.dump(_worker(json.loads(sys.argv[1])), open(sys.argv[2], 'w'))")
            load = load_average()
            subprocess.run([sys.executable, "-c", code, json.dumps(spec), str(out)], check=True,
                           env=_clean_env(spec["threads"]), stdout=subprocess.DEVNULL)
            rows.append({"variant": name, **spec, "load_before": load, **json.loads(out.read_text())})
            log(f"train: {name}: {rows[-1]['tok_s']:.0f} tok/s")
    base = next((r for r in rows if r["variant"] == "hf-1t"), rows[0])
    for r in rows:
        r["vs_base"] = r["tok_s"] / base["tok_s"]
        n = min(len(r["losses"]), len(base["losses"]))
        r["max_loss_diff"] = max(abs(a - b) for a, b in zip(r["losses"][:n], base["losses"][:n]))
    return {"recipe": args.recipe, "base": base["variant"], "rows": rows, "cpus": os.cpu_count(),
            "bf16_hardware": _bf16_hardware(), "load_after": load_average()}


def _bf16_hardware() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); without it bfloat16
    matrix products are emulated and slower than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def markdown(result: dict) -> str:
    lines = [f"Training loop, recipe `{result['recipe']}` ({result['rows'][0]['tokens_per_step']:,} "
             f"tokens a step, {result['rows'][0]['params'] / 1e6:.1f}M parameters), {result['cpus']} CPUs, "
             f"native bfloat16: {'yes' if result['bf16_hardware'] else 'no'}:",
             "",
             f"| loop | threads | tok/s | vs `{result['base']}` | GFLOP/s | warm-up s | "
             f"max loss difference vs `{result['base']}` | load before |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| `{r['variant']}` | {r['threads']} | {r['tok_s']:,.0f} | {r['vs_base']:.2f}x | "
                     f"{r['gflop_s']:.0f} | {r['warm_s']:.0f} | {r['max_loss_diff']:.1e} | "
                     f"{r['load_before']:.2f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    # deferred: matplotlib loads only when a plot is drawn
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    names = [r["variant"] for r in result["rows"]]
    a.barh(names, [r["tok_s"] for r in result["rows"]])
    a.set_xlabel("training tokens/s")
    a.invert_yaxis()
    for r in result["rows"]:
        b.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["variant"])
    b.set_xlabel("step")
    b.set_ylabel("training loss")
    b.legend(fontsize=7)
    fig.suptitle(f"training loop on `{result['recipe']}`")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
