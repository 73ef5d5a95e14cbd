"""Steps cut short when a request arrives (LLMEngine.interrupt_background, the server's submit).

A step of only background rows (batch jobs) stops at its next layer boundary and keeps nothing;
a multi-step decode call keeps the steps it finished. Oracle: the same requests run without
interrupts must give the same tokens (greedy and seeded), on the C++ loop and on the
layer-by-layer path, with the flag set before chosen steps and from another thread at random
points in the middle of steps.
"""
from __future__ import annotations

import random
import threading
import time

import pytest

from leapfrog import SamplingParams
from leapfrog.engine import decode_loop
from leapfrog.engine.llm_engine import LLMEngine
from leapfrog.layers.cpu_kernels import cpu_kernels
from leapfrog.models import llama
from leapfrog.sampling_params import BACKGROUND_PRIORITY

PROMPTS = ["Once upon a time", "The cat liked to play in the sun. One day", "They became friends and", "The dog"]
PARAMS = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=19, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
          SamplingParams(max_tokens=21, temperature=1.0, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=17, temperature=0.7, top_k=8, seed=11, ignore_eos=True)]


def run(engine: LLMEngine, priorities: list[int], interrupt_before=lambda step: False,
        seconds: list[float] | None = None) -> dict[str, list[int]]:
    """Drive the engine as the server's engine thread does: clear the flag, then step (each
    step's wall time appended to `seconds`, when given)."""
    for k, (prompt, params, priority) in enumerate(zip(PROMPTS, PARAMS, priorities)):
        engine.add_request(prompt, params, request_id=f"r{k}", priority=priority)
    out, step = {}, 0
    while engine.has_unfinished():
        engine.clear_interrupt()
        if interrupt_before(step):
            engine.interrupt_background()
        t0 = time.perf_counter()
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
        if seconds is not None:
            seconds.append(time.perf_counter() - t0)
        step += 1
        assert step < 2000, "no progress under interrupts"
    engine.clear_interrupt()
    return out


def interrupted(engine: LLMEngine) -> int:
    return engine.stats.num_interrupted_steps + engine.decode_loop.num_interrupted_calls


@pytest.mark.parametrize("path", ["loop", "layers"])
def test_interrupted_steps_keep_nothing_unfinished(llama_dir, path, monkeypatch):
    if path == "loop" and cpu_kernels() is None:
        pytest.skip("no C++ compiler: the loop is optional")
    if path == "layers":
        monkeypatch.setattr(decode_loop, "ENABLED", False)
        monkeypatch.setattr(llama, "_FORWARD_LOOP", False)
    background = [BACKGROUND_PRIORITY] * 4
    mixed = [0, BACKGROUND_PRIORITY, 0, BACKGROUND_PRIORITY]
    for priorities in (background, mixed):
        plain = run(LLMEngine(str(llama_dir), block_size=4, num_scheduler_steps=5), priorities)
        engine = LLMEngine(str(llama_dir), block_size=4, num_scheduler_steps=5)
        cut = run(engine, priorities, lambda step: step % 3 == 1)
        assert cut == plain and len(plain) == 4
        assert interrupted(engine) > 0
        assert engine.block_manager.num_used_blocks == 0


def test_live_calls_finish_their_first_step(llama_dir):
    """A live multi-step call with the flag already set still makes one step of progress."""
    if cpu_kernels() is None:
        pytest.skip("no C++ compiler: the loop is optional")
    plain = run(LLMEngine(str(llama_dir), num_scheduler_steps=8), [0] * 4)
    engine = LLMEngine(str(llama_dir), num_scheduler_steps=8)
    assert run(engine, [0] * 4, lambda step: True) == plain
    assert engine.stats.num_interrupted_steps == 0 and engine.decode_loop.num_interrupted_calls > 0


def test_interrupts_from_another_thread_mid_step(monkeypatch):
    """The flag set at random moments by another thread, as the server's event loop sets it:
    background forwards stop wherever they are (a decode call mid-step, a prefill mid-layer).
    The pokes come at random intervals up to a little more than the longest step of the same
    requests uninterrupted (the prefill, which keeps nothing when cut), so on any CPU most steps
    are cut somewhere inside and some run whole."""
    for enabled in ((True, False) if cpu_kernels() is not None else (False,)):
        monkeypatch.setattr(decode_loop, "ENABLED", enabled)
        seconds: list[float] = []
        plain = run(LLMEngine("stories", num_scheduler_steps=16), [BACKGROUND_PRIORITY] * 4, seconds=seconds)
        longest = max(seconds)
        engine = LLMEngine("stories", num_scheduler_steps=16)
        stop = threading.Event()
        rng = random.Random(5)

        def poke():
            while not stop.is_set():
                time.sleep(rng.uniform(0.1, 1.5) * longest)
                engine.interrupt_background()
        poker = threading.Thread(target=poke, daemon=True)
        poker.start()
        try:
            cut = run(engine, [BACKGROUND_PRIORITY] * 4)
        finally:
            stop.set()
            poker.join()
        assert cut == plain
        assert interrupted(engine) > 0


@pytest.mark.parametrize("method,extra", [("ngram", dict(verify="fixed", prompt_lookup_min=1)),
                                          ("draft", dict(num_speculative_tokens=4))], ids=["ngram", "draft-self"])
def test_interrupted_speculative_steps_keep_nothing(llama_dir, method, extra):
    """A drafting method's background steps (drafts, verification) cut short and run again give
    the tokens they give uninterrupted."""
    if method == "draft":
        extra = dict(extra, draft_model=str(llama_dir))
    background = [BACKGROUND_PRIORITY] * 4
    plain = run(LLMEngine(str(llama_dir), method=method, block_size=4, **extra), background)
    engine = LLMEngine(str(llama_dir), method=method, block_size=4, **extra)
    assert run(engine, background, lambda step: step % 2 == 1) == plain
    assert interrupted(engine) > 0 and engine.method.stats()["num_verify_steps"] > 0
