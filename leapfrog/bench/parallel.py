"""`leapfrog bench --suite parallel`: one model decoded whole and split over tensor-parallel
ranks on this machine (LLM(tensor_parallel_size=N)), and what the split costs in communication.

For each size: output tokens/s at each concurrency (greedy, --new-tokens each, the same prompts),
and whether the tokens equal the whole model's. The collectives are timed on their own: an
all-reduce of one step's hidden rows between two ranks (gloo on CPU), times the 2 per layer and
1 for the embedding that a step makes, plus the logits' all-gather.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from leapfrog.bench.common import load_average, log, story_prompts

SIZES = (1, 2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp-sizes", type=int, nargs="+", default=list(SIZES), help="parallel: tensor-parallel sizes")


def _collective_worker(rank: int, size: int, port: int, hidden: int, vocab: int, rows: list[int],
                       repeats: int, out: str) -> None:
    from leapfrog.layers import parallel as tp
    torch.set_num_threads(1)
    tp.init(rank, size, f"tcp://127.0.0.1:{port}")
    result = {}
    for r in rows:
        x, logits = torch.randn(r, hidden), torch.randn(r, vocab // size)
        for _ in range(5):
            tp.all_reduce(x)
        t0 = time.perf_counter()
        for _ in range(repeats):
            tp.all_reduce(x)
        reduce_s = (time.perf_counter() - t0) / repeats
        t0 = time.perf_counter()
        for _ in range(repeats):
            tp.all_gather_last(logits)
        result[r] = {"all_reduce_s": reduce_s, "all_gather_s": (time.perf_counter() - t0) / repeats}
    if rank == 0:
        torch.save(result, out)
    tp.shutdown()


def collectives(hidden: int, vocab: int, size: int, rows: list[int], out: Path, repeats: int = 200) -> dict:
    import torch.multiprocessing as mp
    from leapfrog.layers.parallel import free_port
    mp.start_processes(_collective_worker, args=(size, free_port(), hidden, vocab, rows, repeats, str(out)),
                       nprocs=size, join=True, start_method="spawn")
    return torch.load(out)


def run(args: argparse.Namespace) -> dict:
    from leapfrog import LLM, SamplingParams
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    concurrency = args.concurrency or [1, 8]
    rows, reference = [], None
    la = load_average()
    for size in args.tp_sizes:
        llm = LLM(args.model, tensor_parallel_size=size)
        prompts = story_prompts(max(concurrency), llm.tokenizer)
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0))        # warm
        for c in concurrency:
            best, tokens = 0.0, None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                outs = llm.generate(prompts[:c], params)
                dt = time.perf_counter() - t0
                best = max(best, sum(len(o.token_ids) for o in outs) / dt)
                tokens = [o.token_ids for o in outs]
            if size == args.tp_sizes[0]:
                reference = {**(reference or {}), c: tokens}
            same = reference is not None and reference.get(c) == tokens
            rows.append({"tp": size, "concurrency": c, "tok_s": best, "same_tokens": same})
            log(f"parallel: tp {size}, {c} requests: {best:.1f} tok/s, tokens equal to tp {args.tp_sizes[0]}: {same}")
        cfg = llm.engine.hf_config
        if hasattr(llm, "shutdown"):
            llm.shutdown()
        del llm
    hidden, vocab, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    comm = {}
    for size in [s for s in args.tp_sizes if s > 1]:
        timed = collectives(hidden, vocab, size, concurrency, out / "collectives.pt")
        comm[size] = {c: {**t, "per_step_s": (2 * layers + 1) * t["all_reduce_s"] + t["all_gather_s"]}
                      for c, t in timed.items()}
    base = {r["concurrency"]: r["tok_s"] for r in rows if r["tp"] == args.tp_sizes[0]}
    for r in rows:
        r["vs_first"] = r["tok_s"] / base[r["concurrency"]]
        if r["tp"] in comm:
            step_s = r["concurrency"] / r["tok_s"]          # one decode step yields a token per request
            r["comm_per_step_ms"] = 1000 * comm[r["tp"]][r["concurrency"]]["per_step_s"]
            r["comm_share"] = comm[r["tp"]][r["concurrency"]]["per_step_s"] / step_s
    return {"model": args.model, "rows": rows, "load_average_start": la, "load_average_end": load_average(),
            "cpus": os.cpu_count(), "hidden": hidden, "layers": layers, "vocab": vocab, "new_tokens": args.new_tokens}


def markdown(result: dict) -> str:
    lines = [f"`{result['model']}`, {result['new_tokens']} new tokens per request, greedy; load average "
             f"{result['load_average_start']:.2f} -> {result['load_average_end']:.2f}", "",
             "| tensor parallel | requests | tok/s | vs tp 1 | same tokens | collectives per step | share of a step |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        comm = f"{r['comm_per_step_ms']:.2f} ms" if "comm_per_step_ms" in r else "-"
        share = f"{100 * r['comm_share']:.0f}%" if "comm_share" in r else "-"
        lines.append(f"| {r['tp']} | {r['concurrency']} | {r['tok_s']:.1f} | {r['vs_first']:.2f}x | "
                     f"{'yes' if r['same_tokens'] else 'NO'} | {comm} | {share} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3))
    for size in sorted({r["tp"] for r in result["rows"]}):
        rs = [r for r in result["rows"] if r["tp"] == size]
        ax.plot([r["concurrency"] for r in rs], [r["tok_s"] for r in rs], marker="o", label=f"tensor parallel {size}")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"{result['model']} split over ranks ({result['cpus']} CPUs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
