"""Where a block-diffusion request's time goes (docs/benchmarks.md, block diffusion): `ar` and
`diffusion` (N = 1, one threshold) decode the same held-out openings one at a time; for
diffusion, the forwards grouped by their number of query rows (a block's canvas alone, or with
the finished block fed again to store its keys), with the milliseconds each took, next to
`ar`'s milliseconds per token, and the share of the wall time the forwards took.

    .venv/bin/python scripts/diffusion_steps.py [--model stories-large-diffusion]
        [--ar-model stories-large] [--threshold 0.7] [--num-prompts 4] [--new-tokens 64]
"""
from __future__ import annotations

import collections
import time

from leapfrog import LLM, SamplingParams
from leapfrog.bench.common import story_prompts
from spec_common import parse_load_args


def _options(p) -> None:
    p.add_argument("--ar-model", default="stories-large")
    p.add_argument("--threshold", type=float, default=0.7)
    p.add_argument("--num-prompts", type=int, default=4)


def main() -> None:
    args = parse_load_args(__doc__, _options, model="stories-large-diffusion", new_tokens=64)
    ar = LLM(args.ar_model, method="ar", max_batch_size=1)
    dm = LLM(args.model, method="diffusion", max_batch_size=1, threshold=args.threshold, num_blocks=1)
    prompts = story_prompts(args.num_prompts, ar.tokenizer)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0)
    for llm in (ar, dm):
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    by_rows: dict[int, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    runner, inner = dm.engine.runner, dm.engine.runner.run

    def run(batch):
        t = time.perf_counter()
        try:
            return inner(batch)
        finally:
            acc = by_rows[sum(s.num_query for s in batch.seqs)]
            acc[0] += time.perf_counter() - t
            acc[1] += 1
    runner.run = run
    for round_ in range(2):
        t = time.perf_counter()
        outs = ar.generate(prompts, params)
        t_ar = time.perf_counter() - t
        by_rows.clear()
        t = time.perf_counter()
        outd = dm.generate(prompts, params)
        t_dm = time.perf_counter() - t
        n_ar, n_dm = sum(len(o.token_ids) for o in outs), sum(len(o.token_ids) for o in outd)
        forward_s = sum(v[0] for v in by_rows.values())
        forwards = sum(v[1] for v in by_rows.values())
        print(f"round {round_ + 1}: ar {n_ar / t_ar:.1f} tok/s ({t_ar / n_ar * 1e3:.1f} ms a token); diffusion "
              f"{n_dm / t_dm:.1f} tok/s, {forwards} forwards, {n_dm / forwards:.2f} tokens a forward, "
              f"forwards {forward_s / t_dm:.0%} of its wall time")
        for rows in sorted(by_rows):
            s, n = by_rows[rows]
            print(f"  {rows:3d} query rows: {n:4d} forwards, {s / n * 1e3:6.1f} ms each "
                  f"({s / n / (t_ar / n_ar):.2f}x an ar token)")


if __name__ == "__main__":
    main()
