"""Length match of couplets checkpoints on every held-out 上联, with transformers greedy decoding
(what `python -m leapfrog.train.check` measures), and for two folders the exact McNemar test on
the 上联 where they disagree (README, Built-in models).

    .venv/bin/python scripts/couplets_lengths.py checkpoints/couplets [OTHER_FOLDER]
        [--generate repetition_penalty=1.2 ...]   # extra transformers generate() arguments
"""
from __future__ import annotations

import argparse
import json
from math import comb

import torch

from leapfrog.train.check import _strip_eos, generate, load
from leapfrog.data.corpus import heldout


def right_lengths(folder: str, ups: list[str], extra: dict) -> list[bool]:
    model, tok = load(folder)
    gens = generate(model, tok, ups, batch_size=32, do_sample=False,
                    max_new_tokens=max(len(u) for u in ups) + 8, **extra)
    return [len(tok.decode(_strip_eos(g, tok.eos_token_id), skip_special_tokens=True)) == len(u)
            for g, u in zip(gens, ups)]


def mcnemar(a: list[bool], b: list[bool]) -> tuple[int, int, float]:
    """(right only under a, right only under b, two-sided exact p)."""
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    n, k = only_a + only_b, min(only_a, only_b)
    p = min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0
    return only_a, only_b, p


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", help="one or two checkpoint folders")
    p.add_argument("--generate", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    extra = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.generate)}
    ups = [u for u, _ in heldout("couplets")]
    hits = [right_lengths(f, ups, extra) for f in args.folders[:2]]
    for f, h in zip(args.folders, hits):
        print(f"{f}: {sum(h)}/{len(h)} right length ({sum(h) / len(h):.4f})")
    if len(hits) == 2:
        a, b, pval = mcnemar(*hits)
        print(f"right only under the first: {a}, only under the second: {b}, exact McNemar p = {pval:.3f}")


if __name__ == "__main__":
    main()
