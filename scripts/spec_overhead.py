"""What a speculative step costs when it drafts nothing (README, speculative benchmark).

Four engines on the same model in one process, taking turns over the same concurrent requests:
`ar`, a second `ar` engine (the noise floor of "another engine in memory"), DSpark priced so that
it never drafts (probes off), and the same with the target's hidden-state capture and the
drafter's feature queue switched off. Prints each one's output tok/s relative to the first `ar`,
and for the never-drafting engine the seconds spent in the target forwards (runner) and in
queuing features (observe) next to `ar`'s forwards.

    .venv/bin/python scripts/spec_overhead.py [--model stories] [--concurrency 8] [--rounds 4]
"""
from __future__ import annotations

import time

from leapfrog import LLM, SamplingParams
from leapfrog.bench.common import story_prompts
from spec_common import parse_load_args, timed


def main() -> None:
    args = parse_load_args(__doc__)

    def never_drafting() -> LLM:
        return LLM(args.model, method="dspark", verify="confidence", max_batch_size=32)

    engines = {"ar": LLM(args.model, method="ar", max_batch_size=32),
               "ar (second engine)": LLM(args.model, method="ar", max_batch_size=32),
               "dspark, never drafting": never_drafting(),
               "dspark, never drafting, no capture": never_drafting()}
    prompts = story_prompts(args.concurrency, engines["ar"].tokenizer)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0)
    for llm in engines.values():      # warm-up, drafting included (it sets up the drafter's state)
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0))
    for name, llm in engines.items():
        m = llm.engine.method
        if name.startswith("dspark"):
            m.policy.should_draft = lambda records: False      # skip every step
        if name.endswith("no capture"):
            m.capture_layers = ()
            m.observe = lambda *a, **k: None
    runner = {"ar": [0.0], "dspark, never drafting": [0.0]}
    observe = [0.0]
    for name, acc in runner.items():
        timed(engines[name].engine.runner, "run", acc)
    timed(engines["dspark, never drafting"].engine.method, "observe", observe)

    rates = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, llm in engines.items():
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
        print(f"round {r + 1}/{args.rounds}", flush=True)
    base = sum(rates["ar"])
    print(f"{args.concurrency} concurrent requests, {args.rounds} rounds, {args.threads} threads")
    for name, v in rates.items():
        print(f"  {name:36s} {sum(v) / len(v):7.0f} tok/s  {sum(v) / base:.3f}x ar")
    print(f"  target forwards: ar {runner['ar'][0]:.3f} s, never drafting {runner['dspark, never drafting'][0]:.3f} s;"
          f" queuing features (observe) {observe[0]:.3f} s")


if __name__ == "__main__":
    main()
