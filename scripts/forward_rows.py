"""What a target forward of B query rows costs against a decode step of one (README, speculative
and block-diffusion benchmarks): the confidence scheduler's start-up profile, taken several
times, printed with the multiply-adds per second each width reaches.

Speculative verification and block diffusion pay only while a forward of several rows costs
about what one row costs: while reading the weights bounds the step. Past a few rows the two
cores are bound by arithmetic instead; the last column shows where.

    .venv/bin/python scripts/forward_rows.py [--model stories-large] [--rounds 3]
"""
from __future__ import annotations

import argparse

import torch

from leapfrog import LLM
from leapfrog.methods.confidence_schedule import StepCostTable


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="stories-large")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-rows", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--matmul-precision", default=None, help="the engine's matmul_precision (default: the model's)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    extra = {"matmul_precision": args.matmul_precision} if args.matmul_precision else {}
    llm = LLM(args.model, method="ar", max_batch_size=1, **extra)
    model, device = llm.engine.model, llm.engine.runner.device
    cfg = llm.engine.hf_config
    # Multiply-adds per row: every matrix but the embedding table, plus the LM head (tied or not).
    macs = sum(w.numel() for n, w in model.named_parameters() if w.dim() == 2 and "embed_tokens" not in n)
    if not any("lm_head" in n for n, _ in model.named_parameters()):
        macs += cfg["vocab_size"] * cfg["hidden_size"]
    best: dict[int, float] = {}
    for r in range(args.rounds):
        table = StepCostTable.profile(model, device, max_tokens=args.max_rows, repeats=3,
                                     step=llm.engine.timed_step)
        for b, s in zip(table.num_tokens, table.seconds):
            best[b] = min(best.get(b, s), s)
        print(f"round {r + 1}: " + ", ".join(f"{b}: {s * 1e3:.2f} ms" for b, s in zip(table.num_tokens, table.seconds)))
    one = best[1]
    print(f"\n{args.model}: {macs / 1e6:.0f}M multiply-adds a row, best of {args.rounds} rounds "
          "(1 row: a step of the decode loop; more: the layer path's paged forward)")
    print("| rows | ms | x one row | ms per row | GMAC/s |")
    print("|---|---|---|---|---|")
    for b in sorted(best):
        s = best[b]
        print(f"| {b} | {s * 1e3:.2f} | {s / one:.2f}x | {s * 1e3 / b:.2f} | {b * macs / s / 1e9:.0f} |")


if __name__ == "__main__":
    main()
