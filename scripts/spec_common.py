"""What the speculative-decoding scripts share: their command line (a model, how many
concurrent requests, rounds, new tokens per request, CPU threads) and a wall-clock wrapper.
It chooses OpenMP's short spin (GOMP_SPINCOUNT) as the `leapfrog` command does, before torch loads."""
from __future__ import annotations

import argparse
import time

from leapfrog.cli import short_openmp_spin

short_openmp_spin()         # before torch loads
import torch  # noqa: E402


def parse_load_args(doc: str, extra=None, **defaults) -> argparse.Namespace:
    """Parse the shared flags (the script's docstring's first line as the description), plus
    those `extra(parser)` adds, with a script's own `defaults` for any of them, and set torch's
    CPU threads to --threads."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    if extra is not None:
        extra(p)
    p.add_argument("--model", default="stories")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(**defaults)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    return args


def timed(obj, name: str, acc: list[float]) -> None:
    """Wrap obj.name so that its wall time adds up in acc[0] (and its calls in acc[1] if given)."""
    inner = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            acc[0] += time.perf_counter() - t
            if len(acc) > 1:
                acc[1] += 1
    setattr(obj, name, wrapper)
