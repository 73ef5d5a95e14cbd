"""`leapfrog bench`: leapfrog side by side with peers, in one process, one run.

Suites:
  peers        one checkpoint and prompts through leapfrog, transformers `generate` and, when a
               build is found, llama.cpp's llama-bench: decode tok/s at 1 and more requests, as ratios
  speculative  decoding methods against `ar`: batch-1 speed-up, τ and tokens per target forward
               for each shipped drafter, throughput with and without confidence scheduling
  diffusion    block diffusion against `ar` at several thresholds: tokens per forward, batch-1
               speed-up, output quality
  couplets     the couplet writer with and without its rules: how often each holds, parallelism,
               distinct-n, seconds per couplet
  reliability  a `leapfrog serve` process under schema fuzzing, overload, engine crashes, batch jobs
  soak         a long mixed run against `leapfrog serve`: memory growth, idle KV blocks, outcomes
  parallel     a model whole and split over tensor-parallel ranks: tok/s, equal tokens, collectives' cost
  perplexity   perplexity on held-out text by leapfrog, transformers and llama-perplexity (GGUF)
  structured   constrained decoding on a served model: JSON Schema conformance, tool calls,
               constrained against free tok/s, schema compile time
  train        the training loop before and after its lean compiled forward (leapfrog.train.speed;
               `leapfrog bench --suite train --help` lists its flags)
Results: JSON and a markdown table under --out, a PNG plot, the table on stdout. Speed targets
live here, never in tests; ratios are against a baseline measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from leapfrog.bench import (couplets, diffusion, parallel, peers, perplexity, reliability, soak, speculative,
                            structured)
from leapfrog.bench.common import log
from leapfrog.config import DEFAULT_MODEL
from leapfrog.models.loader import CheckpointError

# Counts that must be at least 1 wherever a suite reads them (None: the suite's default).
COUNTS = ("threads", "repeats", "new_tokens", "concurrency", "depths", "prefill", "num_prompts", "gamma", "num_blocks",
          "candidates", "clients", "fuzz_examples", "burst_factor", "ctx", "chunks")

SUITES = {"peers": peers, "speculative": speculative, "diffusion": diffusion, "couplets": couplets,
          "reliability": reliability, "soak": soak, "parallel": parallel, "perplexity": perplexity,
          "structured": structured}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leapfrog bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="peers", choices=list(SUITES),
                   help="what to measure (default peers)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help="concurrent requests (default: 1 4 16 64 for peers, 1 8 32 for speculative)")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per setting; the best is kept (speculative throughput: the median, see its docstring)")
    p.add_argument("--llama-cpp-dir", default=os.environ.get("LLAMA_CPP_DIR"),
                   help="a llama.cpp source tree with a build/ (e.g. built from the llama-cpp-python sdist, "
                   "see docs/benchmarks.md): its converter makes float16 and float32 GGUFs of the same "
                   "weights, and its llama-bench decodes them in a clean environment (default "
                   "$LLAMA_CPP_DIR; skipped when absent)")
    p.add_argument("--gguf", default=None, help="use this float16 GGUF instead of converting")
    p.add_argument("--out", default="bench_results", help="folder for JSON, markdown and PNG")
    p.add_argument("--matmul-precision", choices=["float32", "bfloat16", "int8"], default=None,
                   help="the engines' matmul_precision (peers, speculative, diffusion and perplexity suites; default: "
                        "the model folder's): bfloat16 products with AVX512-BF16 make a step of several rows about "
                        "as cheap as one on a memory-bound model; int8 (a GGUF model's quantized weights) uses "
                        "AVX512-VNNI integer products on int8 activations")
    peers.add_arguments(p)
    speculative.add_arguments(p)
    diffusion.add_arguments(p)
    couplets.add_arguments(p)
    reliability.add_arguments(p)
    soak.add_arguments(p)
    parallel.add_arguments(p)
    perplexity.add_arguments(p)
    structured.add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--serve" in argv:          # load against a running server: serve.py
        # deferred: bench.serve loads only for --serve runs
        from leapfrog.bench import serve
        return serve.main(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in COUNTS:
        value = getattr(args, name, None)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and v < 1:
                parser.error(f"--{name.replace('_', '-')} {v}: must be at least 1")
    for v in getattr(args, "thresholds", None) or []:
        if not 0.0 <= v <= 1.0:
            parser.error(f"--thresholds {v}: a confidence, between 0 and 1")
    if getattr(args, "duration", None) is not None and not args.duration > 0:
        parser.error(f"--duration {args.duration}: must be a positive number of seconds")
    cpp = getattr(args, "llama_cpp_dir", None)
    if cpp and not os.path.isdir(cpp):     # named on purpose: running without it would drop its rows unsaid
        parser.error(f"--llama-cpp-dir {cpp}: not found")
    suite = SUITES[args.suite]
    if args.suite == "speculative":
        args.concurrency = args.concurrency or [1, 8, 32]
    elif args.suite == "peers":
        args.concurrency = args.concurrency or [1, 4, 16, 64]
    try:
        result = suite.run(args)
    except (FileNotFoundError, CheckpointError) as e:    # a model or drafter that is not there or broken
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.suite}.json").write_text(json.dumps(result, indent=2))
    table = suite.markdown(result)
    (out / f"{args.suite}.md").write_text(table + "\n")
    suite.plot(result, out / f"{args.suite}.png")
    print(table)
    log(f"wrote {out}/{args.suite}.json, .md, .png")
    return 0
