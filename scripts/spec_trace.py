"""Confidence-scheduled DSpark under load, step by step (README, speculative benchmark): every
step that drafts, with the batch size, whether it was a re-probe, the re-probe wait in force,
the drafting cost the scheduler priced and the drafting time measured (with the projection
of the context rows queued while not drafting, which the price leaves out); then the time against
`ar` on the same requests (engines alternating, several rounds).

    .venv/bin/python scripts/spec_trace.py [--concurrency 8] [--rounds 4] [--model stories]
"""
from __future__ import annotations

import time

from leapfrog import LLM, SamplingParams
from leapfrog.bench.common import story_prompts
from spec_common import parse_load_args


def main() -> None:
    args = parse_load_args(__doc__)
    engines = {"dspark": LLM(args.model, method="dspark", verify="confidence", max_batch_size=32),
               "ar": LLM(args.model, method="ar", max_batch_size=32)}
    prompts = story_prompts(args.concurrency, engines["ar"].tokenizer)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0)
    for llm in engines.values():
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    m = engines["dspark"].engine.method
    policy = m.policy
    trace: list[dict] = []
    decide, draft = policy.should_draft, m.propose

    def traced_decide(records):
        yes = decide(records)
        if yes and policy.measured is not None:
            trace.append({"batch": len(records), "probe": policy.probing, "wait": policy.reprobe_wait,
                          "priced_ms": 1e3 * policy.measured.draft(len(records))})
        return yes

    def traced_draft(anchors):
        t = time.perf_counter()
        out = draft(anchors)
        if trace and "measured_ms" not in trace[-1]:
            trace[-1].update(measured_ms=1e3 * (time.perf_counter() - t),
                             verified=sum(x.num_verify or 0 for x in out))
        return out
    policy.should_draft, m.propose = traced_decide, traced_draft
    spent = {"dspark": 0.0, "ar": 0.0}
    for r in range(args.rounds):
        for name in (("dspark", "ar") if r % 2 == 0 else ("ar", "dspark")):
            trace.clear()
            t = time.perf_counter()
            engines[name].generate(prompts, params)
            spent[name] += time.perf_counter() - t
            if name == "dspark" and r == args.rounds - 1:
                print(f"round {r + 1}, steps that drafted:")
                for row in trace:
                    print("  " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                           for k, v in row.items()))
    print(f"{args.concurrency} requests, {args.rounds} rounds: confidence-scheduled DSpark "
          f"{spent['ar'] / spent['dspark']:.3f}x ar")


if __name__ == "__main__":
    main()
