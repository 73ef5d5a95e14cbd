"""`leapfrog bench --suite perplexity`: a model's perplexity on held-out text, scored the way
llama.cpp's `llama-perplexity` scores it, by leapfrog, by transformers and by llama-perplexity
itself on the same file (a GGUF model: the same GGUF file for all three).
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import argparse
import math
import re
import subprocess
import time
from pathlib import Path

import torch

from leapfrog import SamplingParams
from leapfrog.bench import llama_cpp
from leapfrog.bench.common import load_average, log, matmul_precision
from leapfrog.config import resolve_model
from leapfrog.checkpoint.gguf import source_of


PREFILL_ROWS = 128


def heldout_text(limit_chars: int) -> str:
    # deferred: data.corpus loads only when held-out text is read
    from leapfrog.data.corpus import heldout
    texts = heldout("stories")
    if not texts:
        raise FileNotFoundError("no held-out stories (../shared/data); pass --text FILE")
    out, size = [], 0
    for t in texts:
        out.append(t.strip())
        size += len(t)
        if size >= limit_chars:
            break
    return "\n\n".join(out) + "\n"


def chunks(ids: list[int], ctx: int, num: int, bos: int | None) -> list[list[int]]:
    out = []
    for k in range(min(num, len(ids) // ctx)):
        chunk = ids[k * ctx:(k + 1) * ctx]
        if bos is not None:
            chunk = [bos] + chunk[1:]
        out.append(chunk)
    return out


def scored(ctx: int) -> range:
    """Positions of a chunk whose tokens are scored (each given everything before it)."""
    return range(ctx // 2 + 1, ctx)


def leapfrog_nll(llm, parts: list[list[int]], ctx: int) -> tuple[float, int]:
    outs = llm.generate(parts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    total, count = 0.0, 0
    for out in outs:
        for j in scored(ctx):
            total -= out.prompt_logprobs[j]["logprob"]
            count += 1
    return total, count


def transformers_nll(folder: Path, parts: list[list[int]], ctx: int) -> tuple[float, int]:
    # deferred: transformers is heavy and only this reference needs it
    import transformers
    gguf = source_of(folder)
    if gguf is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                  dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    total, count = 0.0, 0
    for chunk in parts:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([chunk])).logits[0].float(), -1)
        for j in scored(ctx):
            total -= float(logp[j - 1, chunk[j]])
            count += 1
    return total, count


def llama_perplexity(exe: str, gguf: Path, text_file: Path, ctx: int, num: int, threads: int) -> dict:
    env, dropped = llama_cpp.peer_env()
    cmd = [exe, "-m", str(gguf), "-f", str(text_file), "-c", str(ctx), "--chunks", str(num), "-t", str(threads),
           "-b", str(ctx)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", proc.stdout + proc.stderr)
    if proc.returncode != 0 or not found:
        tail = ((proc.stderr or proc.stdout).strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"llama-perplexity failed ({proc.returncode}): {tail}")
    return {"ppl": float(found.group(1)), "stderr": float(found.group(2)), "command": " ".join(cmd),
            "env_dropped": dropped}


def run(args: argparse.Namespace) -> dict:
    # deferred: the engine loads only when this suite runs
    from leapfrog import LLM
    folder = resolve_model(args.model)
    text = Path(args.text).read_text(encoding="utf-8") if args.text else heldout_text(args.ctx * args.chunks * 8)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text_file = out / "perplexity-text.txt"
    text_file.write_text(text, encoding="utf-8")
    load_before = load_average()
    precision = matmul_precision(args, folder)
    # prompts prefilled 128 rows a step: the products decoding uses (past 256 rows a step, BLAS
    # on the dequantized weights would score instead)
    llm = LLM(str(folder), method="ar", num_threads=args.threads, max_batch_size=4, matmul_precision=precision,
              max_num_batched_tokens=PREFILL_ROWS)
    tok = llm.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    bos = tok.bos_token_id if tok.encode("x") != tok.encode("x", add_special_tokens=False) else None
    parts = chunks(ids, args.ctx, args.chunks, bos)
    if not parts:
        raise FileNotFoundError(f"the text has {len(ids)} tokens: fewer than one chunk of {args.ctx}")
    log(f"{folder.name}: {len(parts)} chunks of {args.ctx} tokens ({len(ids)} in the text)")
    rows = []
    t0 = time.perf_counter()
    nll, n = leapfrog_nll(llm, parts, args.ctx)
    rows.append({"engine": f"leapfrog ({precision} products)", "ppl": math.exp(nll / n), "scored_tokens": n,
                 "seconds": time.perf_counter() - t0})
    del llm
    if not args.no_transformers:
        t0 = time.perf_counter()
        nll, n = transformers_nll(folder, parts, args.ctx)
        rows.append({"engine": "transformers", "ppl": math.exp(nll / n), "scored_tokens": n,
                     "seconds": time.perf_counter() - t0})
    exe = llama_cpp.find_binary("llama-perplexity", args.llama_cpp_dir)
    gguf = source_of(folder) or (Path(args.gguf) if args.gguf else None)
    if exe and gguf:
        t0 = time.perf_counter()
        r = llama_perplexity(exe, gguf, text_file, args.ctx, len(parts), args.threads)
        rows.append({"engine": "llama.cpp", "ppl": r["ppl"], "stderr": r["stderr"], "command": r["command"],
                     "env_dropped": r["env_dropped"], "seconds": time.perf_counter() - t0})
    base = rows[0]["ppl"]
    for r in rows:
        r["vs_leapfrog"] = r["ppl"] / base
    return {"suite": "perplexity", "model": str(folder), "gguf": str(gguf) if gguf else None, "ctx": args.ctx,
            "matmul_precision": precision,
            "chunks": len(parts), "text_tokens": len(ids), "threads": args.threads, "rows": rows,
            "load_average": [load_before, load_average()],
            "timestamp": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("perplexity suite")
    g.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity's -c; default 512)")
    g.add_argument("--chunks", type=int, default=16, help="chunks scored (default 16)")
    g.add_argument("--text", default=None, help="a text file (default: held-out stories from ../shared/data)")


def markdown(result: dict) -> str:
    rows = ["| engine | perplexity | vs leapfrog | scored tokens | seconds |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        ppl = f"{r['ppl']:.4f}" + (f" ± {r['stderr']:.4f}" if "stderr" in r else "")
        rows.append(f"| {r['engine']} | {ppl} | {r['vs_leapfrog']:.4f} | {r.get('scored_tokens', '-')} | "
                    f"{r['seconds']:.1f} |")
    return "\n".join(rows) + (f"\n{Path(result['model']).name}{' (' + Path(result['gguf']).name + ')' if result['gguf'] else ''}: "
                              f"{result['chunks']} chunks of {result['ctx']} tokens, the second half of each "
                              f"scored; {result['threads']} threads; {result['timestamp']}.")


def plot(result: dict, path: Path) -> None:
    # deferred: matplotlib loads only when a plot is drawn
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3))
    names = [r["engine"] for r in result["rows"]]
    ax.bar(names, [r["ppl"] for r in result["rows"]], yerr=[r.get("stderr", 0) for r in result["rows"]])
    ax.set(ylabel="perplexity", title=f"{Path(result['model']).name}: {result['chunks']} x {result['ctx']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
