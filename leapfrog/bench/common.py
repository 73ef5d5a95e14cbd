"""Helpers every benchmark suite shares: progress logging and held-out story prompts."""
from __future__ import annotations

import os
import sys
import time


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def story_prompts(num: int, tokenizer, max_prompt_tokens: int = 32) -> list[list[int]]:
    """Openings of held-out stories (our own split); synthetic text if the data is absent."""
    try:
        # deferred: data.corpus (numpy) loads only when story prompts are built
        from leapfrog.data.corpus import heldout
        texts = heldout("stories")
    except (FileNotFoundError, ImportError):
        texts = [f"Once upon a time there was a little {w} who liked to play."
                 for w in ("cat", "dog", "girl", "boy", "bird", "fish", "bear", "fox")]
    prompts = []
    for i in range(num):
        ids = tokenizer.encode(texts[i % len(texts)])
        prompts.append(ids[:max_prompt_tokens])
    return prompts


def load_average() -> float:
    """The 1-minute load average, recorded with every table (these VMs swing in speed)."""
    return os.getloadavg()[0]


def read_bandwidth(threads: int, num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of reading a 1 GiB float32 tensor with `threads` threads, best of `repeats`:
    the ceiling for single-request decode of a model too big for the caches, which reads every
    weight once per token."""
    # deferred: torch is heavy and only the bandwidth measurement needs it here
    import torch
    torch.set_num_threads(threads)
    x = torch.ones(num_bytes // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


def matmul_precision(args, model_dir) -> str:
    """The products a suite's engines run with: --matmul-precision, else the model folder's
    default (its leapfrog.json), else float32. bfloat16 or int8 on a CPU without AVX512-BF16 or
    AVX512-VNNI is float32, as the engine runs it (it falls back), so the tables name the products
    that ran."""
    # deferred: the layers and the model loader (torch) load only when a run sets its precision
    from leapfrog.layers import linear
    from leapfrog.models.loader import model_engine_options
    precision = getattr(args, "matmul_precision", None) or \
        model_engine_options(model_dir).get("matmul_precision", "float32")
    missing = linear.products_available(precision)
    if missing:
        print(f"[bench] this CPU has no {missing}: the engines run float32 products", file=sys.stderr)
        return "float32"
    return precision

