"""The peers suite: the same checkpoint and prompts through leapfrog, transformers `generate` and
llama.cpp's llama-bench (on both its float16 and float32 GGUF of the same weights, when a build is
given), interleaved repeat by repeat. Single-request decode is reported in tokens/s and in GB/s of
weights read per token, next to the machine's measured read bandwidth, its physical limit; total
output tokens/s at several concurrencies against transformers. `--size 150m` measures a
random-weight Llama of that size instead, whose weights do not fit the CPU caches."""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from leapfrog import SamplingParams
from leapfrog.config import resolve_model
from leapfrog.checkpoint.gguf import source_of


from leapfrog.bench import llama_cpp
from leapfrog.bench.common import load_average, log, matmul_precision, read_bandwidth, story_prompts
from leapfrog.bench.random_model import random_llama, weight_bytes_per_token


# --- leapfrog -------------------------------------------------------------------------------
def leapfrog_run(llm, prompts: list[list[int]], new_tokens: int) -> dict:
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


def leapfrog_prompt_run(llm, prompt_tokens: int, seed: int) -> dict:
    """A prompt of `prompt_tokens` random token ids (new ones each call, so the prefix cache never
    answers) read to its first token: prompt tokens a second over the wall-clock."""
    vocab = int(llm.engine.hf_config.get("vocab_size", 256))
    rng = random.Random(seed)
    ids = [rng.randrange(min(100, vocab // 4), vocab) for _ in range(prompt_tokens)]
    t0 = time.perf_counter()
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "prompt_tokens_per_s": prompt_tokens / wall}


# --- transformers -----------------------------------------------------------------------------
def transformers_run(args: argparse.Namespace, folder: Path, prompts: list[list[int]], pad: int) -> dict:
    """transformers in its own clean process (hf_peer.py): single-request decode and a static
    batch per concurrency level. The sequential time of a level is estimated from the
    single-request time (running 64 requests one by one would take minutes and says nothing new);
    the faster of the two counts."""
    env, dropped = llama_cpp.peer_env()
    job = {"model": str(folder), "threads": args.threads, "new_tokens": args.new_tokens, "pad_id": pad,
           "single": prompts[0], "batches": [prompts[:c] for c in args.concurrency]}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("hf_peer.py"))], input=json.dumps(job),
                          capture_output=True, text=True, env=env, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {}
    n = args.new_tokens
    for c, batched in zip(args.concurrency, out["batches"]):
        sequential = out["single"]["wall_s"] * c
        best = min(batched, sequential)
        rows[c] = {"tokens_per_s": c * n / best, "mode": "static batch" if best == batched else "sequential"}
    return {"single": {**out["single"], "env_dropped": dropped}, "rows": rows, "version": out["transformers"]}


# --- the suite --------------------------------------------------------------------------------
def model_folder(args: argparse.Namespace) -> Path:
    folder = resolve_model(args.model)
    if args.size:
        log(f"building (or reusing) a random {args.size} Llama with {folder.name}'s tokenizer")
        folder = random_llama(args.size, folder, Path(args.out))
    return folder


def llama_cpp_peers(args: argparse.Namespace, folder: Path, precision: str = "float32") -> dict[str, Path]:
    """The GGUFs llama.cpp decodes: float16 (the bytes leapfrog streams) and float32, and with
    leapfrog's bfloat16 products bfloat16 too (llama.cpp's own bfloat16 dot products)."""
    exe = llama_cpp.find_binary("llama-bench", args.llama_cpp_dir)
    if exe is None:
        return {}
    source = source_of(folder)
    if source is not None:              # a GGUF model: llama.cpp decodes the very same file
        return {gguf_kind(source): source}
    out = Path(args.out)
    ggufs = {"f16": Path(args.gguf)} if args.gguf else {}
    for kind in ("f16", "f32") + (("bf16",) if precision == "bfloat16" else ()):
        ggufs.setdefault(kind, llama_cpp.make_gguf(folder, args.llama_cpp_dir, out, kind))
    return {kind: g for kind, g in ggufs.items() if g is not None}


def interleaved(args: argparse.Namespace, llm, folder: Path, prompts: list[list[int]], pad: int,
                ggufs: dict[str, Path]) -> tuple[dict[str, dict], dict[int, dict], dict[int, dict], dict[int, dict],
                                              str | None]:
    """Best of `repeats` rounds; each round runs every engine once, in turn: leapfrog (single
    request, then each concurrency), llama.cpp on each GGUF (with its own repetitions), and
    transformers in its own process. On a shared machine the best of a few interleaved runs is
    far more stable than one run each."""
    exe = llama_cpp.find_binary("llama-bench", args.llama_cpp_dir)
    single: dict[str, dict] = {}
    rows: dict[int, dict] = {}
    depths: dict[int, dict] = {}       # cached positions -> engine -> best run after them
    prompts_in: dict[int, dict] = {}   # prompt tokens -> engine -> best prompt processing run
    version = None

    def keep(table: dict, key, r: dict, field: str) -> None:
        if key not in table or r[field] > table[key][field]:
            table[key] = r
    for i in range(args.repeats):
        log(f"round {i + 1}/{args.repeats}")
        leapfrog_run(llm, prompts[:1], 16)      # warm-up after the other engines, as llama-bench's own
        keep(single, "leapfrog", leapfrog_run(llm, prompts[:1], args.new_tokens), "decode_tokens_per_s")
        for depth in args.depths or []:         # decode after `depth` cached positions, both engines
            long = (prompts[0] * (depth // max(1, len(prompts[0])) + 1))[:max(1, depth)]
            at = depths.setdefault(depth, {})
            keep(at, "leapfrog", leapfrog_run(llm, [long], args.new_tokens), "decode_tokens_per_s")
            for kind, gguf in ggufs.items():
                keep(at, f"llama.cpp {kind}",
                     llama_cpp.llama_bench(exe, gguf, args.new_tokens, args.threads, 3, depth), "decode_tokens_per_s")
        for n in args.prefill or []:            # prompt processing of n tokens, both engines
            at = prompts_in.setdefault(n, {})
            keep(at, "leapfrog", leapfrog_prompt_run(llm, n, seed=1000 * i + n), "prompt_tokens_per_s")
            for kind, gguf in ggufs.items():
                keep(at, f"llama.cpp {kind}", llama_cpp.llama_bench_prompt(exe, gguf, n, args.threads, 3),
                     "prompt_tokens_per_s")
        for c in args.concurrency:
            r = leapfrog_run(llm, prompts[:c], args.new_tokens)
            keep(rows, c, {"leapfrog": r["tokens_per_s"]}, "leapfrog")
        for kind, gguf in ggufs.items():
            keep(single, f"llama.cpp {kind}", llama_cpp.llama_bench(exe, gguf, args.new_tokens, args.threads, 3),
                 "decode_tokens_per_s")
        if not args.no_transformers and source_of(folder) is None:     # (no GGUF loading in hf_peer)
            hf = transformers_run(args, folder, prompts, pad)
            version = hf["version"]
            keep(single, "transformers", hf["single"], "decode_tokens_per_s")
            for c, r in hf["rows"].items():
                best = rows[c].setdefault("transformers", 0.0)
                if r["tokens_per_s"] > best:
                    rows[c].update(transformers=r["tokens_per_s"], transformers_mode=r["mode"])
    return single, rows, depths, prompts_in, version


def gguf_kind(path: Path) -> str:
    """The name of a GGUF file's weight type in the table ("Q4_1 file")."""
    found = re.search(r"(Q\d_K(_[SML])?|Q\d_\d|F16|BF16|F32)", path.name, re.I)
    return f"{found.group(1).upper() if found else 'gguf'} file"


def kernel_bytes(model) -> int:
    """Bytes of weights a one-row decode step of `model` reads on a CPU: each linear's packed
    panels (quantized, float16, bfloat16 or float32) or the weight the few-row kernel reads."""
    # deferred: layers.linear loads only when kernel bytes are counted
    from leapfrog.layers.linear import kernel_panels, kernel_weight
    total = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            t = kernel_panels(m)
            t = t if t is not None else kernel_weight(m)
            total += t.numel() * t.element_size()
    return total


def single_rows(best: dict[str, dict], folder: Path, leapfrog_bytes: int | None = None) -> list[dict]:
    f16 = weight_bytes_per_token(folder, 2)
    source = source_of(folder)
    out = []
    for name, r in best.items():
        per_token = f16 * (2 if name in ("llama.cpp f32", "transformers") else 1)   # both read float32
        if source is not None:     # llama.cpp reads the file's blocks, leapfrog its panels
            per_token = source.stat().st_size if name.startswith("llama.cpp") else (leapfrog_bytes or per_token)
        tps = r["decode_tokens_per_s"]
        out.append({"engine": name, "decode_tokens_per_s": tps, "ms_per_token": 1000 / tps,
                    "weight_bytes_per_token": per_token, "weight_gb_per_s": per_token * tps / 1e9,
                    "vs_leapfrog": tps / best["leapfrog"]["decode_tokens_per_s"],
                    **{k: r[k] for k in ("command", "env_dropped") if k in r}})
    return out


def concurrency_table(rows: dict[int, dict]) -> list[dict]:
    out = []
    for c in sorted(rows):
        r = {"concurrency": c, **rows[c]}
        if "transformers" in r:
            r["ratio"] = r["leapfrog"] / r["transformers"]
        out.append(r)
    return out


def run_peers(args: argparse.Namespace) -> dict:
    """leapfrog runs in this process, which never imports transformers (importing it slowed
    leapfrog's decoding measurably); every peer runs in a clean process of its own."""
    # deferred: the engine loads only when this suite runs
    from leapfrog import LLM
    torch.set_num_threads(args.threads)
    folder = model_folder(args)
    load_before = load_average()
    log(f"model {folder}, {args.threads} threads, {args.new_tokens} new tokens per request")
    precision = matmul_precision(args, folder)
    llm = LLM(str(folder), method="ar", max_batch_size=max(args.concurrency), num_threads=args.threads,
              matmul_precision=precision)
    pad = llm.tokenizer.pad_token_id or 0
    prompts = story_prompts(max(args.concurrency), llm.tokenizer)
    leapfrog_run(llm, prompts[:2], 8)                      # warm up
    ggufs = llama_cpp_peers(args, folder, precision)
    single, rows, depths, prompts_in, hf_version = interleaved(args, llm, folder, prompts, pad, ggufs)
    # Last: touching a gigabyte first slowed the engines' later runs on these VMs.
    bandwidth = read_bandwidth(args.threads)
    return {"suite": "peers", "model": str(folder), "size": args.size, "threads": args.threads,
            "matmul_precision": precision,
            "new_tokens": args.new_tokens, "torch": torch.__version__, "transformers": hf_version,
            "read_bandwidth_gb_per_s": bandwidth / 1e9, "load_average": [load_before, load_average()],
            "leapfrog_env": {k: v for k, v in os.environ.items() if k.startswith(llama_cpp.DROPPED_PREFIXES)},
            "single": single_rows(single, folder, kernel_bytes(llm.engine.model)),
            "depths": ratio_rows(depths, "depth", "decode_tokens_per_s"),
            "prefill": ratio_rows(prompts_in, "prompt_tokens", "prompt_tokens_per_s"), "rows": concurrency_table(rows),
            "timestamp": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def ratio_rows(runs_by_size: dict[int, dict], size_key: str, rate_key: str) -> list[dict]:
    """One row per size (--depths' cached positions, --prefill's prompt length): every engine's
    `rate_key` and leapfrog's over it."""
    out = []
    for size, runs in sorted(runs_by_size.items()):
        lf = runs["leapfrog"][rate_key]
        peers = {name: r[rate_key] for name, r in runs.items() if name != "leapfrog"}
        out.append({size_key: size, "leapfrog": lf, "peers": peers,
                    "ratios": {name: lf / rate for name, rate in peers.items()}})
    return out


run = run_peers      # every suite module offers run / markdown / plot


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("peers suite")
    g.add_argument("--size", default=None, help="measure a random-weight Llama of this many parameters "
                   "(e.g. 150m: weights far larger than the CPU caches) instead of --model's weights; "
                   "it keeps --model's tokenizer")
    g.add_argument("--depths", type=int, nargs="+", default=None, metavar="N",
                   help="also decode one request after N cached positions (a prompt of N tokens), "
                   "against llama-bench -d N")
    g.add_argument("--prefill", type=int, nargs="+", default=None, metavar="N",
                   help="also time a prompt of N tokens read to its first token, against llama-bench -p N -n 0")
    g.add_argument("--no-transformers", action="store_true", help="leave transformers out (slow on big models; peers and perplexity suites)")


def markdown(result: dict) -> str:
    lines = [f"Single request, {result['new_tokens']} new tokens, {result['threads']} threads, leapfrog with "
             f"{result.get('matmul_precision', 'float32')} products; machine read "
             f"bandwidth {result['read_bandwidth_gb_per_s']:.1f} GB/s; load average "
             f"{result['load_average'][0]:.2f} -> {result['load_average'][1]:.2f}"
             + (f"; {result['timestamp']}" if "timestamp" in result else ""), "",
             "| engine | decode tok/s | ms / token | GB/s of weights | vs leapfrog |", "|---|---|---|---|---|"]
    for r in result["single"]:
        lines.append(f"| {r['engine']} | {r['decode_tokens_per_s']:.0f} | {r['ms_per_token']:.2f} | "
                     f"{r['weight_gb_per_s']:.1f} | {r['vs_leapfrog']:.2f}x |")
    lines += _ratio_table(result.get("depths"), "depth", "cached positions", "tok/s")
    lines += _ratio_table(result.get("prefill"), "prompt_tokens", "prompt tokens", "prompt tok/s")
    has_hf = any("transformers" in r for r in result["rows"])
    lines += ["", "| requests | leapfrog tok/s |" + (" transformers tok/s | leapfrog / transformers |" if has_hf else ""),
              "|" + "---|" * (4 if has_hf else 2)]
    for r in result["rows"]:
        line = f"| {r['concurrency']} | {r['leapfrog']:.0f} |"
        if has_hf:
            line += f" {r['transformers']:.0f} ({r['transformers_mode']}) | {r['ratio']:.2f}x |"
        lines.append(line)
    return "\n".join(lines)


def _ratio_table(rows: list[dict] | None, size_key: str, size_title: str, unit: str) -> list[str]:
    """The markdown of ratio_rows' rows (none: no lines)."""
    if not rows:
        return []
    names = sorted({n for r in rows for n in r["peers"]})
    lines = ["", f"| {size_title} | leapfrog {unit} |" + "".join(f" {n} {unit} | vs {n} |" for n in names),
             "|" + "---|" * (2 + 2 * len(names))]
    for r in rows:
        lines.append(f"| {r[size_key]} | {r['leapfrog']:.0f} |" + "".join(
            f" {r['peers'][n]:.0f} | {r['ratios'][n]:.2f}x |" if n in r["peers"] else " - | - |" for n in names))
    return lines


def plot(result: dict, path: Path) -> None:
    # deferred: matplotlib loads only when a plot is drawn
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    depths = result.get("depths") or []
    fig, axes = plt.subplots(1, 3 if depths else 2, figsize=(15 if depths else 10, 3.8))
    a, b = axes[0], axes[1]
    single = result["single"]
    a.barh([r["engine"] for r in single], [r["weight_gb_per_s"] for r in single], color="tab:blue")
    a.axvline(result["read_bandwidth_gb_per_s"], color="tab:red", ls="--", label="measured read bandwidth")
    a.set_xlabel("GB/s of weights read, single request")
    a.legend(loc="lower right", fontsize=8)
    rows = result["rows"]
    xs = [r["concurrency"] for r in rows]
    b.plot(xs, [r["leapfrog"] for r in rows], "o-", label="leapfrog")
    if all("transformers" in r for r in rows):
        b.plot(xs, [r["transformers"] for r in rows], "s--", label="transformers")
    b.set_xscale("log", base=2)
    b.set_xlabel("concurrent requests")
    b.set_ylabel("output tokens/s")
    b.legend()
    if depths:        # decode after cached positions: position 0 is the single-request row
        c = axes[2]
        base = {r["engine"]: r["decode_tokens_per_s"] for r in single}
        xs = [0] + [r["depth"] for r in depths]
        c.plot(xs, [base["leapfrog"]] + [r["leapfrog"] for r in depths], "o-", label="leapfrog")
        for name in sorted({n for r in depths for n in r["peers"]}):
            if name in base and all(name in r["peers"] for r in depths):
                c.plot(xs, [base[name]] + [r["peers"][name] for r in depths], "s--", label=name)
        c.set_xlabel("cached positions before decoding")
        c.set_ylabel("decode tok/s, one request")
        c.set_ylim(bottom=0)
        c.legend(fontsize=8)
    fig.suptitle(f"{Path(result['model']).name}, {result['threads']} CPU threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
