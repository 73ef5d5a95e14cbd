"""Where one request's DSpark cycle spends its time (README, speculative benchmark): `ar` and
DSpark (`dspark-markov-2l`, all γ verified) decode the same held-out openings one at a time,
taking turns prompt by prompt; for DSpark the wall time per cycle of the target's verify
forward, of drafting, and inside drafting of the context projection, the drafter's layers
and the sequential Markov stage. Then a confidence-scheduled engine on the same prompts: the
step and drafting costs it measured and how many drafts it chose to verify. Last, the C++
Markov stage on one thread against two.

    .venv/bin/python scripts/spec_batch1.py [--num-prompts 12] [--torch-drafting]

--torch-drafting turns the two drafting kernels off (the Markov stage and the context
projection then run as torch ops, as before they existed).
"""
from __future__ import annotations

import collections
import time

from leapfrog import LLM, SamplingParams
from leapfrog.bench.common import story_prompts
from spec_common import parse_load_args, timed


def _options(p) -> None:
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--torch-drafting", action="store_true", help="the drafting kernels off")


def main() -> None:
    args = parse_load_args(__doc__, _options)
    import torch

    from leapfrog.layers.cpu_kernels import cpu_kernels
    from leapfrog.methods import drafters
    from leapfrog.models.dflash import DFlashDraftModel
    from leapfrog.models.dflash_heads import MarkovHead

    if args.torch_drafting:
        MarkovHead.fused_argmax = lambda self, *a: None
        DFlashDraftModel._fused_context_kv = lambda self, *a: None
    engines = {"ar": LLM(args.model, method="ar", max_batch_size=1),
               "dspark": LLM(args.model, method="dspark", max_batch_size=1),
               "confidence": LLM(args.model, method="dspark", verify="confidence", max_batch_size=1)}
    prompts = story_prompts(args.num_prompts, engines["ar"].tokenizer)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0)
    for llm in engines.values():
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    m = engines["dspark"].engine.method
    parts = {name: [0.0, 0] for name in ("verify forward", "drafting", "context projection",
                                         "drafter layers", "Markov stage")}
    timed(engines["dspark"].engine.runner, "run", parts["verify forward"])
    timed(m, "propose", parts["drafting"])
    timed(m.drafter, "flush_contexts", parts["context projection"])
    timed(m.drafter, "forward", parts["drafter layers"])
    # sample_block is a module function that the confidence-scheduled engine calls too: count
    # only the calls made while the fixed-γ engine decodes.
    running = [""]
    stage = parts["Markov stage"]
    real_stage = drafters.sample_block

    def sample_block(*a, **k):
        t = time.perf_counter()
        try:
            return real_stage(*a, **k)
        finally:
            if running[0] == "dspark":
                stage[0] += time.perf_counter() - t
                stage[1] += 1
    drafters.sample_block = sample_block
    chosen = collections.Counter()
    cm = engines["confidence"].engine.method
    real_draft = cm.propose

    def draft(anchors):
        props = real_draft(anchors)
        chosen.update(p.num_verify for p in props)
        return props
    cm.propose = draft

    wall = dict.fromkeys(engines, 0.0)
    toks = dict.fromkeys(engines, 0)
    for p in prompts:
        for name, llm in engines.items():
            running[0] = name
            t = time.perf_counter()
            out = llm.generate([p], params)[0]
            wall[name] += time.perf_counter() - t
            toks[name] += len(out.token_ids)
    ar_rate = toks["ar"] / wall["ar"]
    print(f"{args.num_prompts} prompts at batch 1, {args.threads} threads"
          f"{', drafting kernels off' if args.torch_drafting else ''}")
    for name in engines:
        rate = toks[name] / wall[name]
        print(f"  {name:12s} {rate:6.0f} tok/s  {rate / ar_rate:.2f}x ar")
    cycles = parts["verify forward"][1]
    print(f"dspark, ms per cycle ({cycles} cycles, {toks['dspark'] / cycles:.2f} tokens each):")
    for name, (secs, _) in parts.items():
        print(f"  {name:20s} {1e3 * secs / cycles:6.2f}")
    mc = cm.policy.measured
    total = sum(chosen.values())
    print("confidence-scheduled: measured step ms at 1 / 5 / 9 tokens "
          f"{1e3 * mc.cost(1):.2f} / {1e3 * mc.cost(5):.2f} / {1e3 * mc.cost(9):.2f}, drafting "
          f"{1e3 * mc.draft(1):.2f}; drafts verified (share of drafting steps): "
          + ", ".join(f"{n}: {c / total:.0%}" for n, c in sorted(chosen.items())))
    mod = cpu_kernels()
    head = m.drafter.markov_head
    if mod is not None and head is not None and head.kind == "vanilla":
        vocab = head.markov_w1.weight.shape[0]
        base, anchor = torch.randn(1, m.num_speculative_tokens, vocab), torch.tensor([5])
        _, w2t = head._transposed()
        for threads in (1, 2):
            t = time.perf_counter()
            for _ in range(200):
                mod.markov_argmax(base.clone(), head.markov_w1.weight, w2t, anchor, threads)
            print(f"C++ Markov stage, {threads} thread(s): {1e3 * (time.perf_counter() - t) / 200:.3f} ms")


if __name__ == "__main__":
    main()
