"""The peers suite: the same checkpoint and prompts through leapfrog and through transformers
`generate` (and llama.cpp's llama-bench when a build is found): single-request decode tokens/s
and total output tokens/s at several concurrencies, reported as ratios."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from leapfrog.config import resolve_model


from leapfrog.bench.common import log, story_prompts


# --- leapfrog -------------------------------------------------------------------------------
def leapfrog_run(llm, prompts: list[list[int]], new_tokens: int) -> dict:
    from leapfrog import SamplingParams
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    n = sum(o.metrics.num_output_tokens for o in outs)
    res = {"wall_s": wall, "output_tokens": n, "tokens_per_s": n / wall,
           "tokens_per_forward": n / max(1, sum(o.metrics.num_forwards for o in outs))}
    if len(prompts) == 1:
        m = outs[0].metrics
        res["decode_tokens_per_s"] = (m.num_output_tokens - 1) / (m.total_time - m.time_to_first_token)
    return res


# --- transformers -----------------------------------------------------------------------------
def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """Left-padded static batch through `generate`; returns wall seconds."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t0


def hf_run(model, prompts: list[list[int]], new_tokens: int, pad_id: int, single_time: float | None) -> dict:
    batched = hf_generate(model, prompts, new_tokens, pad_id)
    # Sequential time, estimated from the measured single-request time (running 64 requests one
    # by one would take minutes and says nothing new).
    sequential = single_time * len(prompts) if single_time else None
    best = min(t for t in (batched, sequential) if t is not None)
    n = len(prompts) * new_tokens
    return {"wall_s": best, "output_tokens": n, "tokens_per_s": n / best,
            "mode": "static batch" if best == batched else "sequential",
            "static_batch_tokens_per_s": n / batched}


def hf_single(model, prompt: list[int], new_tokens: int, pad_id: int) -> dict:
    prefill = min(hf_generate(model, [prompt], 1, pad_id) for _ in range(2))
    total = hf_generate(model, [prompt], new_tokens, pad_id)
    return {"wall_s": total, "tokens_per_s": new_tokens / total,
            "decode_tokens_per_s": (new_tokens - 1) / max(1e-9, total - prefill)}


# --- llama.cpp --------------------------------------------------------------------------------
def find_llama_bench(cpp_dir: str | None) -> str | None:
    cands = [os.environ.get("LLAMA_BENCH"), shutil.which("llama-bench")]
    if cpp_dir:
        cands += [str(Path(cpp_dir) / "build" / "bin" / "llama-bench"), str(Path(cpp_dir) / "bin" / "llama-bench")]
    return next((c for c in cands if c and Path(c).is_file()), None)


def make_gguf(folder: Path, cpp_dir: str | None, out: Path) -> Path | None:
    """Convert the checkpoint with llama.cpp's own converter (identical weights, f32)."""
    if not cpp_dir:
        return None
    root = Path(cpp_dir)
    if not (root / "convert_hf_to_gguf.py").is_file():
        return None
    gguf = out / f"{folder.name}-f32.gguf"
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    proc = subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(folder), "--outfile",
                           str(gguf), "--outtype", "f32"], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        log(f"llama.cpp converter refused {folder}: {tail}; no llama.cpp column")
        return None
    return gguf


def llama_cpp_single(gguf: Path | None, new_tokens: int, threads: int, cpp_dir: str | None) -> dict | None:
    exe = find_llama_bench(cpp_dir)
    if not exe or gguf is None or not gguf.is_file():
        return None
    out = subprocess.run([exe, "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-t", str(threads), "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    return {"decode_tokens_per_s": float(json.loads(out)[0]["avg_ts"]), "exe": exe}


# --- the suite --------------------------------------------------------------------------------
def run_peers(args: argparse.Namespace) -> dict:
    import transformers

    from leapfrog import LLM
    folder = resolve_model(args.model)
    torch.set_num_threads(args.threads)
    log(f"model {folder}, {args.threads} threads, {args.new_tokens} new tokens per request")
    llm = LLM(str(folder), method="ar", max_batch_size=max(args.concurrency))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pad = llm.tokenizer.pad_token_id or 0
    prompts = story_prompts(max(args.concurrency), llm.tokenizer)
    leapfrog_run(llm, prompts[:2], 8)                      # warm both up
    hf_generate(hf, prompts[:2], 8, pad)
    # Alternate the engines and keep each one's best run: on a shared machine the best of a
    # few interleaved runs is far more stable than one run each.
    lf1 = hf1 = None
    for i in range(args.repeats):
        log(f"single request, run {i + 1}/{args.repeats}")
        r = leapfrog_run(llm, prompts[:1], args.new_tokens)
        lf1 = r if lf1 is None or r["decode_tokens_per_s"] > lf1["decode_tokens_per_s"] else lf1
        r = hf_single(hf, prompts[0], args.new_tokens, pad)
        hf1 = r if hf1 is None or r["decode_tokens_per_s"] > hf1["decode_tokens_per_s"] else hf1
    rows = [{"concurrency": "single (decode)", "leapfrog": lf1["decode_tokens_per_s"],
             "transformers": hf1["decode_tokens_per_s"]}]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf = Path(args.gguf) if args.gguf else make_gguf(folder, args.llama_cpp_dir, out_dir)
    cpp = llama_cpp_single(gguf, args.new_tokens, args.threads, args.llama_cpp_dir)
    if cpp:
        log(f"llama.cpp: {cpp['exe']} on {gguf}")
    if cpp:
        rows[0]["llama.cpp"] = cpp["decode_tokens_per_s"]
    for c in args.concurrency:
        lf = h = None
        for i in range(args.repeats):
            log(f"{c} concurrent requests, run {i + 1}/{args.repeats}")
            r = leapfrog_run(llm, prompts[:c], args.new_tokens)
            lf = r if lf is None or r["tokens_per_s"] > lf["tokens_per_s"] else lf
            r = hf_run(hf, prompts[:c], args.new_tokens, pad, hf1["wall_s"])
            h = r if h is None or r["tokens_per_s"] > h["tokens_per_s"] else h
        rows.append({"concurrency": c, "leapfrog": lf["tokens_per_s"], "transformers": h["tokens_per_s"],
                     "transformers_mode": h["mode"]})
    for r in rows:
        r["ratio"] = r["leapfrog"] / r["transformers"]
    return {"suite": "peers", "model": str(folder), "threads": args.threads, "new_tokens": args.new_tokens,
            "torch": torch.__version__, "transformers": transformers.__version__, "rows": rows}


run = run_peers      # every suite module offers run / markdown / plot


def markdown(result: dict) -> str:
    has_cpp = any("llama.cpp" in r for r in result["rows"])
    head = "| requests | leapfrog tok/s | transformers tok/s | leapfrog / transformers |" + \
           (" llama.cpp tok/s |" if has_cpp else "")
    lines = [head, "|" + "---|" * (5 if has_cpp else 4)]
    for r in result["rows"]:
        mode = f" ({r['transformers_mode']})" if "transformers_mode" in r else ""
        line = f"| {r['concurrency']} | {r['leapfrog']:.0f} | {r['transformers']:.0f}{mode} | {r['ratio']:.2f}x |"
        if has_cpp:
            line += f" {r['llama.cpp']:.0f} |" if "llama.cpp" in r else " — |"
        lines.append(line)
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] if isinstance(r["concurrency"], int)]
    xs = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(xs, [r["leapfrog"] for r in rows], "o-", label="leapfrog")
    ax.plot(xs, [r["transformers"] for r in rows], "s--", label="transformers")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{Path(result['model']).name}, {result['threads']} CPU threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
