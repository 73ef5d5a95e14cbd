"""`leapfrog bench --suite parallel`: one model decoded whole and split over ranks on this
machine: tensor-parallel ranks, pipeline stages, or both (LLM(tensor_parallel_size=N,
pipeline_parallel_size=M)), and what the split costs in communication.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from leapfrog.bench.common import load_average, log, story_prompts

LAYOUTS = ("1x1", "2x1", "1x2")


def layout(text: str) -> tuple[int, int]:
    """"TxP": tensor_parallel_size x pipeline_parallel_size."""
    try:
        t, p = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected TxP, e.g. 2x1 (tensor parallel 2, one stage)") from None
    if t < 1 or p < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be >= 1")
    return t, p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", type=layout, nargs="+", default=[layout(x) for x in LAYOUTS],
                   help="parallel: layouts as TxP, tensor-parallel size x pipeline stages (default 1x1 2x1 1x2)")


def _collective_worker(rank: int, size: int, port: int, hidden: int, vocab: int, rows: list[int],
                       repeats: int, out: str, stages: int) -> None:
    # deferred: layers.parallel loads only in the collectives' worker processes
    from leapfrog.layers import parallel as tp
    torch.set_num_threads(1)
    tp.init(rank, size, f"tcp://127.0.0.1:{port}", pipeline_size=stages)
    result = {}
    for r in rows:
        x, logits = torch.randn(r, hidden), torch.randn(r, vocab // tp.tp_size())
        if stages == 1:
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
            continue
        t0 = time.perf_counter()
        for _ in range(repeats):          # stage 0 -> 1 -> ... : the hidden rows' trip through the stages
            if not tp.is_first_stage():
                x = tp.recv_prev(x.shape, x.dtype)
            if not tp.is_last_stage():
                tp.send_next(x).wait()
        send_s = (time.perf_counter() - t0) / repeats / (stages - 1)
        full = torch.randn(r, vocab)
        t0 = time.perf_counter()
        for _ in range(repeats):
            tp.broadcast_from_stage(full, stages - 1)
        result[r] = {"send_s": send_s, "broadcast_s": (time.perf_counter() - t0) / repeats}
    if rank == 0:
        torch.save(result, out)
    tp.shutdown()


def collectives(hidden: int, vocab: int, size: int, rows: list[int], out: Path, repeats: int = 200,
                stages: int = 1) -> dict:
    # deferred: layers.parallel loads only when collectives are measured
    from leapfrog.layers.parallel import free_port
    mp.start_processes(_collective_worker, args=(size, free_port(), hidden, vocab, rows, repeats, str(out), stages),
                       nprocs=size, join=True, start_method="spawn")
    return torch.load(out)


def run(args: argparse.Namespace) -> dict:
    # deferred: torch and the engine load only when this suite runs
    from leapfrog import LLM, SamplingParams
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    concurrency = args.concurrency or [1, 8]
    rows, reference = [], None
    la = load_average()
    first = args.layouts[0]
    for t, p in args.layouts:
        llm = LLM(args.model, tensor_parallel_size=t, pipeline_parallel_size=p)
        prompts = story_prompts(max(concurrency), llm.tokenizer)
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0))        # warm
        for c in concurrency:
            best, tokens, bubble = 0.0, None, None
            for _ in range(args.repeats):
                before = llm.engine.parallel_stats() if p > 1 else None
                t0 = time.perf_counter()
                outs = llm.generate(prompts[:c], params)
                dt = time.perf_counter() - t0
                if dt and sum(len(o.token_ids) for o in outs) / dt > best:
                    best = sum(len(o.token_ids) for o in outs) / dt
                    bubble = _bubble(before, llm.engine.parallel_stats()) if p > 1 else None
                tokens = [o.token_ids for o in outs]
            if (t, p) == first:
                reference = {**(reference or {}), c: tokens}
            same = reference is not None and reference.get(c) == tokens
            rows.append({"tp": t, "pp": p, "concurrency": c, "tok_s": best, "same_tokens": same, "bubble": bubble})
            log(f"parallel: tp {t} x pp {p}, {c} requests: {best:.1f} tok/s, tokens equal to {first[0]}x{first[1]}: "
                f"{same}" + (f", bubble {bubble:.0%}" if bubble is not None else ""))
        cfg = llm.engine.hf_config
        if hasattr(llm, "shutdown"):
            llm.shutdown()
        del llm
    hidden, vocab, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    comm = {}
    for t, p in [lay for lay in args.layouts if lay != (1, 1)]:
        if t > 1 and p > 1:
            continue                                        # not timed: its rows carry no communication figure
        timed = collectives(hidden, vocab, t * p, concurrency, out / "collectives.pt", stages=p)
        if p == 1:
            comm[(t, p)] = {c: (2 * layers + 1) * x["all_reduce_s"] + x["all_gather_s"] for c, x in timed.items()}
        else:
            comm[(t, p)] = {c: (p - 1) * x["send_s"] + x["broadcast_s"] for c, x in timed.items()}
    base = {r["concurrency"]: r["tok_s"] for r in rows if (r["tp"], r["pp"]) == first}
    for r in rows:
        r["vs_first"] = r["tok_s"] / base[r["concurrency"]]
        if (r["tp"], r["pp"]) in comm:
            step_s = r["concurrency"] / r["tok_s"]          # one decode step yields a token per request
            per_step = comm[(r["tp"], r["pp"])][r["concurrency"]]
            r["comm_per_step_ms"] = 1000 * per_step
            r["comm_share"] = per_step / step_s
    return {"model": args.model, "rows": rows, "load_average_start": la, "load_average_end": load_average(),
            "cpus": os.cpu_count(), "hidden": hidden, "layers": layers, "vocab": vocab, "new_tokens": args.new_tokens}


def _bubble(before: list[dict], after: list[dict]) -> float | None:
    """Mean over the ranks of the share of pipelined-step time not spent on the rank's own layers."""
    shares = []
    for b, a in zip(before, after):
        secs = a["seconds"] - b["seconds"]
        if secs > 0:
            shares.append(1 - (a["busy_seconds"] - b["busy_seconds"]) / secs)
    return sum(shares) / len(shares) if shares else None


def markdown(result: dict) -> str:
    lines = [f"`{result['model']}`, {result['new_tokens']} new tokens per request, greedy; load average "
             f"{result['load_average_start']:.2f} -> {result['load_average_end']:.2f}", "",
             "| tensor parallel x stages | requests | tok/s | vs first | same tokens | communication per step "
             "| share of a step | pipeline bubble |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        comm = f"{r['comm_per_step_ms']:.2f} ms" if "comm_per_step_ms" in r else "-"
        share = f"{100 * r['comm_share']:.0f}%" if "comm_share" in r else "-"
        bubble = f"{100 * r['bubble']:.0f}%" if r.get("bubble") is not None else "-"
        lines.append(f"| {r['tp']} x {r['pp']} | {r['concurrency']} | {r['tok_s']:.1f} | {r['vs_first']:.2f}x | "
                     f"{'yes' if r['same_tokens'] else 'NO'} | {comm} | {share} | {bubble} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    # deferred: matplotlib loads only when a plot is drawn
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3))
    for lay in sorted({(r["tp"], r["pp"]) for r in result["rows"]}):
        rs = [r for r in result["rows"] if (r["tp"], r["pp"]) == lay]
        ax.plot([r["concurrency"] for r in rs], [r["tok_s"] for r in rs], marker="o",
                label=f"tensor parallel {lay[0]} x {lay[1]} stage(s)")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"{result['model']} split over ranks ({result['cpus']} CPUs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
