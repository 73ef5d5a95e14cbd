"""The C++ decode loop (leapfrog/engine/decode_loop.py, csrc/decode_loop.cpp) against one step at a time.

Oracle: the layer-by-layer path (the loop switched off), itself checked against torch in
test_cpu_kernels.py and test_parity.py. Several steps per call, one step per call and the
layer path must give the same tokens, finish reasons and logprobs for greedy and seeded
sampling, with stop strings, stop token ids, max_tokens, min_tokens, aborts and preemption,
alone and in batches (including batches past the few-row kernel, which use packed panels).
"""
from __future__ import annotations

import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.engine import decode_loop
from leapfrog.engine.llm_engine import LLMEngine
from leapfrog.layers.cpu_kernels import cpu_kernels
from leapfrog.sample.sampler import Sampler, filter_logits
from leapfrog.sequence import Sequence

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C++ compiler: the loop is optional")

PROMPTS = ["Once upon a time", "The cat liked to play in the sun. One day", "春回大地", "They became friends and",
           "The dog", "A big red ball"]


def outputs(llm: LLM, prompts, params, loop: bool, monkeypatch) -> list[tuple]:
    monkeypatch.setattr(decode_loop, "ENABLED", loop)
    outs = llm.generate(prompts, params)
    monkeypatch.setattr(decode_loop, "ENABLED", True)
    return [(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in outs]


def three_ways(model, prompts, params, monkeypatch, **engine):
    """(layer path, the loop one step per call, the loop five steps per call), fresh engines."""
    layer = outputs(LLM(str(model), **engine), prompts, params, False, monkeypatch)
    one = outputs(LLM(str(model), num_scheduler_steps=1, **engine), prompts, params, True, monkeypatch)
    multi_llm = LLM(str(model), num_scheduler_steps=5, **engine)
    multi = outputs(multi_llm, prompts, params, True, monkeypatch)
    return layer, one, multi, multi_llm.engine


def mixed_params(base_text_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=13, temperature=0.9, top_p=0.9, top_k=20, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=1.0, seed=2**64 - 3, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0.8, min_p=0.05, seed=-5, stop_token_ids=[base_text_token]),
        SamplingParams(max_tokens=12, temperature=1.2, top_k=5),                       # unseeded
        SamplingParams(max_tokens=9, temperature=0.7, min_tokens=6, stop_token_ids=[base_text_token], seed=3),
    ]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_loop_equals_one_step_for_greedy_and_seeded_batches(family_dirs, family, threads, monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        base = LLM(str(family_dirs[family])).generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0))[0]
        params = mixed_params(base.token_ids[3])
        layer, one, multi, engine = three_ways(family_dirs[family], PROMPTS, params, monkeypatch, block_size=4)
    finally:
        torch.set_num_threads(before)
    assert layer == one == multi
    assert engine.decode_loop.num_loop_steps > engine.decode_loop.num_calls > 0     # several steps per call ran


def test_loop_on_the_float16_builtin_model(monkeypatch):
    """`stories` ships float16 weights: the loop streams the float16 copies, as the layers do."""
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True)]
    layer, one, multi, engine = three_ways("stories", PROMPTS[:2], params, monkeypatch)
    assert layer == one == multi
    assert engine.decode_loop.num_loop_steps >= 30


def test_stop_strings_end_where_single_steps_end(llama_dir, monkeypatch):
    base = LLM(str(llama_dir)).generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    params = []
    for i, o in enumerate(base):
        stop = o.text[5:7] if len(o.text) > 8 else "zz"
        params.append(SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop],
                                     include_stop_str_in_output=i % 2 == 0, logprobs=1 if i == 3 else None))
    layer, one, multi, _ = three_ways(llama_dir, PROMPTS, params, monkeypatch)
    assert layer == one == multi
    assert sum(r[2] == "stop" for r in multi) >= 4
    for tokens, text, reason, _ in multi:
        assert reason != "stop" or len(tokens) < 16


def test_penalties_and_logprobs_rows_take_the_logits_back(llama_dir, monkeypatch):
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=10, temperature=0.8, seed=4, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True, frequency_penalty=0.5)]
    layer, one, multi, engine = three_ways(llama_dir, PROMPTS[:3], params, monkeypatch)
    assert layer == one == multi
    assert engine.decode_loop.num_calls > 0


def test_big_batches_use_the_panels_in_the_loop(llama_dir, monkeypatch):
    prompts = [f"{w} {v}" for w in ("the cat", "a dog", "the sun", "big", "red ball", "girl")
               for v in ("ran", "saw", "played", "jumped", "was happy", "sat", "said")]
    assert len(prompts) > 32
    params = [SamplingParams(max_tokens=6 + i % 5, temperature=0 if i % 2 else 0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    layer, one, multi, engine = three_ways(llama_dir, prompts, params, monkeypatch, max_num_batched_tokens=4096)
    assert layer == one == multi
    assert engine.decode_loop.num_loop_steps > engine.decode_loop.num_calls


def drain(engine: LLMEngine, abort_after: int | None = None) -> dict[str, list[int]]:
    out, steps = {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] = o.token_ids
        steps += 1
        if steps == abort_after:
            engine.abort("b")
    return out


def test_aborts_and_preemption_keep_the_other_outputs(llama_dir, monkeypatch):
    params = SamplingParams(max_tokens=30, temperature=0.9, seed=8, ignore_eos=True)
    results = []
    for enabled, steps in ((False, 1), (True, 4)):
        monkeypatch.setattr(decode_loop, "ENABLED", enabled)
        engine = LLMEngine(str(llama_dir), block_size=4, kv_cache_tokens=64, enable_prefix_caching=False,
                           num_scheduler_steps=steps)
        for rid, prompt in zip("abcd", PROMPTS):
            engine.add_request(prompt, params, request_id=rid)
        got = drain(engine, abort_after=3)
        results.append(({k: v for k, v in got.items() if k != "b"}, engine.scheduler.num_preemptions))
        assert engine.block_manager.num_used_blocks == 0
    (layer, pre_layer), (loop, pre_loop) = results
    assert layer == loop and set(loop) == {"a", "c", "d"}
    assert pre_layer > 0 and pre_loop > 0


def test_waiting_requests_are_admitted_at_the_next_step(llama_dir):
    """While a request waits, the loop runs one step per call: the newcomer starts after one
    step, not after num_scheduler_steps."""
    engine = LLMEngine(str(llama_dir), max_batch_size=1, num_scheduler_steps=8)
    engine.add_request("Once upon", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), request_id="a")
    engine.add_request("The cat", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), request_id="b")
    engine.step()                                          # a's prefill and first token
    before = engine.decode_loop.num_loop_steps
    engine.step()
    assert engine.decode_loop.num_loop_steps == before + 1   # b waits: one step
    drain(engine)


# --- the sampler ---------------------------------------------------------------------------------

def seq_with(**params) -> Sequence:
    return Sequence("r", [1, 2], SamplingParams(**params))


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=6),
                                      dict(temperature=1.3, top_p=0.8), dict(temperature=1.0, min_p=0.1),
                                      dict(temperature=0.9, top_k=10, top_p=0.7, min_p=0.02)])
def test_sampler_follows_the_filtered_distribution(settings):
    """The C++ sampler's draws over 20,000 counters of one key follow the distribution that
    torch's filters give (chi-square at p = 0.001), and never leave its support."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 40, generator=g) * 2
    seq = seq_with(seed=99, **settings)
    sampler = Sampler(torch.device("cpu"))
    n = 20000
    temps, top_k, top_p, min_p, keys, _ = sampler.row_settings([seq] * n)
    tokens = cpu_kernels().sample_rows(logits.repeat(n, 1), temps, top_k, top_p, min_p, keys, torch.arange(n))
    probs = filter_logits(logits / settings["temperature"], top_k[:1], top_p[:1], min_p[:1]).softmax(-1)[0].double()
    counts = torch.bincount(tokens, minlength=40).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support] * n
    chi2 = ((counts[support] - expected) ** 2 / expected).sum().item()
    df = int(support.sum()) - 1
    assert df >= 3
    assert chi2 < df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3   # p = 0.001 (Wilson-Hilferty)


@pytest.mark.parametrize("scale", [0.05, 0.5, 2.0, 8.0])
def test_top_p_keeps_exactly_the_tokens_brute_force_keeps(scale):
    """Top-p over a large vocabulary (flat rows leave tens of thousands of candidates, which the
    sampler narrows by thresholds and selection before sorting) draws the token that the same
    draw gives over the kept set found by brute force: probabilities sorted, each token kept
    while the mass strictly above it is at most top_p. Rows whose last kept token is too close
    to call in float64 are skipped."""
    mod = cpu_kernels()
    g = torch.Generator().manual_seed(int(scale * 100))
    n, V = 48, 20000
    logits = torch.randn(n, V, generator=g) * scale
    logits[::5, :3] += 6.0
    temps = torch.full((n,), 0.7)
    top_p = torch.tensor([0.1, 0.5, 0.9, 0.97] * (n // 4))
    keys, counters = torch.arange(n) * 7919 + 5, torch.arange(n)
    zeros_k = torch.zeros(n, dtype=torch.long)
    got = mod.sample_rows(logits, temps, zeros_k, top_p, torch.zeros(n), keys, counters)
    masked = torch.full_like(logits, float("-inf"))
    checked = 0
    for r in range(n):
        q = (logits[r] / temps[r]).double()
        prob = torch.exp(q - q.max())
        order = sorted(range(V), key=lambda t: (-prob[t].item(), t))
        above = torch.cumsum(prob[order], 0) - prob[order]
        limit = top_p[r].item() * prob.sum().item()
        keep = [t for t, a in zip(order, above.tolist()) if a <= limit]
        nxt = above[len(keep)].item() if len(keep) < V else float("inf")
        if abs(above[len(keep) - 1].item() - limit) < 2e-6 * limit or abs(nxt - limit) < 2e-6 * limit:
            continue
        masked[r, keep] = logits[r, keep]
        checked += 1
    want = mod.sample_rows(masked, temps, zeros_k, torch.ones(n), torch.zeros(n), keys, counters)
    rows = [r for r in range(n) if torch.isfinite(masked[r]).any()]
    assert len(rows) == checked >= 3 * n // 4
    assert got[rows].tolist() == want[rows].tolist()
    assert len(set(got.tolist())) > n // 4


def test_sampler_greedy_ties_nans_and_counters():
    mod = cpu_kernels()
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [0.0, float("nan"), 5.0, 1.0], [1.0, 2.0, 0.5, 2.0]])
    zeros = torch.zeros(3)
    got = mod.sample_rows(logits, zeros, torch.zeros(3, dtype=torch.long), torch.ones(3), zeros,
                          torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    assert got.tolist() == [1, 1, 1]                        # lowest index among ties; NaN wins, as torch.argmax
    row = torch.randn(1, 50).repeat(200, 1)
    ones = torch.ones(200)
    keys = torch.full((200,), 12345, dtype=torch.long)
    draw = lambda counters: mod.sample_rows(row, ones, torch.zeros(200, dtype=torch.long), ones,
                                            torch.zeros(200), keys, counters).tolist()
    a = draw(torch.arange(200))
    assert a == draw(torch.arange(200)) and len(set(a)) > 5       # a pure function of (key, counter)
    assert a[50:] == draw(torch.arange(50, 250))[:150]


def test_speculative_steps_without_drafts_run_in_the_loop_and_feed_the_drafter(llama_dir, monkeypatch):
    """Steps a verify policy decided not to draft in run in the decode loop, which returns the
    tapped layers' rows: the drafter's context K/V at every later draft equal the layer path's
    bit for bit, and so do the tokens, drafts and forwards."""
    from test_speculative import write_drafter

    from leapfrog.methods.verify import VerifyPolicy

    class EverySixth(VerifyPolicy):       # drafts at every sixth decision, deterministically
        name = "test"

        def __init__(self) -> None:
            self.n = 0

        def should_draft(self, records, batch=None) -> bool:
            self.n += 1
            return self.n % 6 == 0

        def steps_without_drafting(self, batch: int) -> int:
            return 6 - self.n % 6 if self.n % 6 else 0

        def skipped_in_loop(self, steps: int, batch: int) -> None:
            self.n += steps - 1

    drafter = write_drafter(llama_dir.parent / "loop-dspark", llama_dir, "dspark", num_layers=2, block_size=4)
    runs = []
    for enabled in (False, True):
        monkeypatch.setattr(decode_loop, "ENABLED", enabled)
        llm = LLM(str(llama_dir), method="dspark", draft_model=str(drafter), num_scheduler_steps=16)
        method = llm.engine.method
        method.policy = EverySixth()
        seen = []
        real = method.propose

        def propose(anchors, real=real, method=method, seen=seen):
            props = real(anchors)
            seen.append([[k.clone() for k in method.state(a.seq).context.keys] for a in anchors])
            return props
        method.propose = propose
        outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        runs.append(([o.token_ids for o in outs], [o.metrics.num_forwards for o in outs], seen,
                     method.stats()["num_drafted_tokens"], llm.engine.decode_loop))
    (tok_a, fwd_a, seen_a, drafted_a, _), (tok_b, fwd_b, seen_b, drafted_b, ms) = runs
    assert tok_a == tok_b and fwd_a == fwd_b and drafted_a == drafted_b > 0
    assert ms.num_loop_steps > ms.num_calls > 0          # the skipped steps ran in the loop
    assert len(seen_a) == len(seen_b) > 1
    for a, b in zip(seen_a, seen_b):
        for ka, kb in zip(a, b):
            assert all(torch.equal(x, y) for x, y in zip(ka, kb))


def test_one_request_spreads_its_attention_over_two_threads(model_root, monkeypatch):
    """A single request of a model with 3 KV heads on 2 threads: the loop hands each thread
    chunks of the context (128 positions each) instead of whole heads; the tokens over a
    context of several chunks are the layer path's, which walks each head's chunks in
    one task."""
    from tests.conftest import build_model

    folder = build_model(model_root / "kv3", "llama", num_attention_heads=6, num_key_value_heads=3,
                         hidden_size=96, max_position_embeddings=1024)
    prompt = [5 + (i * 7) % 50 for i in range(300)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        layer, one, multi, engine = three_ways(folder, [prompt], [params], monkeypatch, block_size=16)
        seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
        assert outputs(LLM(str(folder)), [prompt], seeded, False, monkeypatch) == \
            outputs(LLM(str(folder), num_scheduler_steps=4), [prompt], seeded, True, monkeypatch)
    finally:
        torch.set_num_threads(before)
    assert layer == one == multi
    assert engine.decode_loop.num_loop_steps > engine.decode_loop.num_calls > 0
