"""Scheduler with a fake decoding method and no model.

FakeMethod is a Method (methods/base.py): `num_extra_tokens` asks for k draft slots, `prepare`
feeds the known tokens (plus k dummy drafts), and `commit` appends `1 + accepted` tokens and
keeps `num_known + accepted` KV slots, i.e. for a decode step `1 + accepted`, rolling back the
rejected drafts exactly as speculative decoding does. Every step also checks the invariants
the runner relies on (positions, block tables large enough, block reference counts).
"""
from __future__ import annotations

from typing import Callable

import pytest

from leapfrog.engine.block_manager import BlockManager
from leapfrog.methods.base import Batch, Commit, Method
from leapfrog.sampling_params import SamplingParams
from leapfrog.engine.scheduler import Scheduler, SchedulerConfig
from leapfrog.sequence import Sequence, SequenceStatus

BS = 4
TOKEN = 7
DRAFT = 3


class FakeMethod(Method):
    name = "fake"

    def __init__(self, k: int = 0, next_token: Callable[[Sequence], int] | None = None,
                 accept: Callable[[Sequence, int], int] | None = None) -> None:
        self.k = k
        self.next_token = next_token or (lambda seq: TOKEN)
        self.accept = accept or (lambda seq, extra: extra)
        self.finished: list[str] = []
        self.steps = 0

    def num_extra_tokens(self, seq: Sequence) -> int:
        return self.k

    def prepare(self, batch: Batch) -> None:
        for s in batch.seqs:
            s.query_ids = s.seq.token_ids[s.start_pos:s.start_pos + s.num_known] + [DRAFT] * s.num_extra
            s.num_logits = 1 + s.num_extra if s.reaches_end else 0

    def commit(self, batch: Batch, out: object) -> list[Commit]:
        self.steps += 1
        commits = []
        for s in batch.seqs:
            if not s.num_logits:
                commits.append(Commit([], s.num_known, counted_forward=False))
                continue
            accepted = max(0, min(self.accept(s.seq, s.num_extra), s.num_extra))
            tokens, tmp = [], list(s.seq.token_ids)
            for _ in range(accepted + 1):     # each token may depend on the ones before it
                probe = Sequence(s.seq.request_id, tmp, s.seq.params, s.seq.num_prompt_tokens)
                tokens.append(self.next_token(probe))
                tmp.append(tokens[-1])
            commits.append(Commit(tokens, s.num_known + accepted))
        return commits

    def on_finished(self, seq: Sequence) -> None:
        self.finished.append(seq.request_id)


def make(num_blocks=64, k=0, prefix=True, eos=(2,), **cfg):
    method = cfg.pop("method", None) or FakeMethod(k)
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix)
    sched = Scheduler(SchedulerConfig(**cfg), bm, method, list(eos))
    return sched, bm, method


def req(rid, n=6, priority=0, start=10, **params) -> Sequence:
    params.setdefault("max_tokens", 4)
    return Sequence(rid, list(range(start, start + n)), SamplingParams(**params), priority=priority)


def check(sched: Scheduler, batch: Batch | None = None) -> None:
    bm = sched.bm
    live = sched.running + sched.waiting
    refs = [0] * bm.num_blocks
    for s in live:
        for b in s.block_table:
            refs[b] += 1
    assert [b.ref_count for b in bm.blocks] == refs, "block reference counts leaked"
    assert set(bm.free) == {i for i, r in enumerate(refs) if r == 0}
    for s in sched.waiting:
        assert s.block_table == [] and s.status == SequenceStatus.WAITING
    for s in sched.running:
        assert s.status == SequenceStatus.RUNNING
        assert len(s.block_table) >= -(-s.num_computed // BS)
    if batch is not None:
        assert len(batch.seqs) <= sched.config.max_batch_size
        assert batch.num_tokens <= sched.config.max_num_batched_tokens
        assert len({id(s.seq) for s in batch.seqs}) == len(batch.seqs)
        for s in batch.seqs:
            assert s.seq in sched.running
            assert s.start_pos == s.seq.num_computed
            assert s.start_pos + s.num_known <= len(s.seq.token_ids)
            assert len(s.seq.block_table) * BS >= s.start_pos + s.num_query


def step(sched: Scheduler) -> tuple[Batch, list[Sequence]]:
    batch = sched.schedule()
    check(sched, batch)
    changed = []
    if batch.seqs:
        sched.method.prepare(batch)
        assert all(len(s.query_ids) == s.num_query for s in batch.seqs)
        changed = sched.apply(batch, sched.method.commit(batch, None))
    check(sched)
    for s in sched.running:     # after a step: KV is held exactly for the computed tokens
        assert len(s.block_table) == -(-s.num_computed // BS)
    return batch, changed


def run_all(sched: Scheduler, max_steps: int = 1000) -> list[Batch]:
    batches = []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return batches
        batches.append(step(sched)[0])
    raise AssertionError("scheduler did not finish")


def ids(batch: Batch) -> list[str]:
    return [s.seq.request_id for s in batch.seqs]


# --- continuous batching -------------------------------------------------------------------

def test_request_joins_next_step_and_finished_leave():
    sched, bm, _ = make()
    a = req("a", max_tokens=5)
    sched.add(a)
    b1, _ = step(sched)
    assert ids(b1) == ["a"] and b1.seqs[0].num_known == 6     # whole prompt
    b2, _ = step(sched)
    assert ids(b2) == ["a"] and b2.seqs[0].num_known == 1     # decode
    b = req("b", max_tokens=2, start=50)
    sched.add(b)
    b3, _ = step(sched)
    assert ids(b3) == ["a", "b"]                               # joins mid-way
    assert [s.num_known for s in b3.seqs] == [1, 6]
    b4, changed = step(sched)
    assert ids(b4) == ["a", "b"]
    assert b.is_finished and b.finish_reason == "length" and b.output_ids == [TOKEN, TOKEN]
    assert b not in sched.running and b in changed
    b5, _ = step(sched)
    assert ids(b5) == ["a"]                                    # finished requests leave
    assert a.is_finished and a.num_output_tokens == 5
    assert not sched.has_unfinished
    assert bm.num_used_blocks == 0


def test_apply_returns_changed_sequences_and_counts_forwards():
    sched, _, _ = make(max_num_batched_tokens=4)
    a = req("a", n=10, max_tokens=3)
    sched.add(a)
    outs = [step(sched)[1] for _ in range(3)]
    assert outs[0] == [] and outs[1] == [] and outs[2] == [a]  # chunks 4, 4, 2
    assert a.metrics.num_forwards == 1 and a.num_output_tokens == 1
    run_all(sched)
    assert a.metrics.num_forwards == 3
    assert a.metrics.first_token_time is not None and a.metrics.finished_time is not None


# --- chunked prefill ------------------------------------------------------------------------

def test_chunked_prefill_50_tokens_budget_16_takes_4_steps():
    sched, bm, _ = make(max_num_batched_tokens=16)
    a = req("a", n=50, max_tokens=2)
    sched.add(a)
    chunks = []
    while not a.output_ids:
        batch, _ = step(sched)
        assert ids(batch) == ["a"]
        chunks.append((batch.seqs[0].start_pos, batch.seqs[0].num_known, batch.seqs[0].num_logits))
    assert chunks == [(0, 16, 0), (16, 16, 0), (32, 16, 0), (48, 2, 1)]
    assert a.num_computed == 50
    run_all(sched)
    assert a.output_ids == [TOKEN, TOKEN] and bm.num_used_blocks == 0


def test_running_decodes_before_new_prefills():
    sched, bm, _ = make(max_num_batched_tokens=16)
    a, c = req("a", n=3, max_tokens=20), req("c", n=3, max_tokens=20, start=80)
    sched.add(a)
    sched.add(c)
    step(sched)
    b = req("b", n=50, max_tokens=2, start=100)
    sched.add(b)
    batch, _ = step(sched)
    assert ids(batch) == ["a", "c", "b"]
    assert [s.num_known for s in batch.seqs] == [1, 1, 14]   # b gets what the decodes leave
    batch, _ = step(sched)
    assert ids(batch) == ["a", "c", "b"]
    assert [s.num_known for s in batch.seqs] == [1, 1, 14]
    run_all(sched)
    assert b.output_ids == [TOKEN, TOKEN] and bm.num_used_blocks == 0


def test_without_chunked_prefill_prompt_waits_for_budget():
    sched, _, _ = make(max_num_batched_tokens=16, chunked_prefill=False)
    a = req("a", n=3, max_tokens=3)
    sched.add(a)
    step(sched)
    b = req("b", n=16, max_tokens=1, start=40)
    sched.add(b)
    batch, _ = step(sched)
    assert ids(batch) == ["a"]                # 1 + 16 > 16: b waits for a to finish
    run_all(sched)
    assert b.is_finished and b.output_ids == [TOKEN]


# --- batch size ----------------------------------------------------------------------------------

def test_max_batch_size_respected():
    sched, bm, _ = make(max_batch_size=2)
    seqs = [req(f"r{i}", start=10 * i, max_tokens=3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    batches = run_all(sched)
    assert max(len(b.seqs) for b in batches) == 2
    assert all(s.is_finished and s.output_ids == [TOKEN] * 3 for s in seqs)
    assert bm.num_used_blocks == 0
    # FIFO: the first two finish before the last starts
    first = {s.seq.request_id: i for i, b in reversed(list(enumerate(batches))) for s in b.seqs}
    assert first["r0"] == first["r1"] == 0 and first["r2"] > 0 and first["r4"] >= first["r2"]


# --- preemption ----------------------------------------------------------------------------------

def test_preemption_newest_first_recomputes_and_everything_finishes():
    sched, bm, method = make(num_blocks=6, prefix=False)
    seqs = [req(r, n=4, start=10 * i, max_tokens=12) for i, r in enumerate("abc")]
    for s in seqs:
        sched.add(s)
    a, b, c = seqs
    victim_outputs = None
    resumed = None
    for _ in range(200):
        if not sched.has_unfinished:
            break
        was_running = list(sched.running)
        batch, _ = step(sched)
        if victim_outputs is None and sched.num_preemptions:
            assert c.metrics.num_preemptions == 1          # newest goes first
            assert a.metrics.num_preemptions == b.metrics.num_preemptions == 0
            assert c in was_running and c not in sched.running and c in sched.waiting
            assert c.block_table == [] and c.num_computed == 0
            assert "c" in method.finished                  # method state released
            victim_outputs = list(c.output_ids)
            assert victim_outputs                           # it had produced output
        if victim_outputs is not None and resumed is None and "c" in ids(batch) \
                and c.metrics.num_preemptions == 1 and batch.seqs[ids(batch).index("c")].start_pos == 0:
            item = batch.seqs[ids(batch).index("c")]
            resumed = item.num_known
            assert resumed == 4 + len(victim_outputs)      # prompt + output recomputed
            assert c.output_ids[:len(victim_outputs)] == victim_outputs
    assert victim_outputs is not None and resumed is not None
    assert all(s.is_finished and s.finish_reason == "length" for s in seqs)
    assert all(s.output_ids == [TOKEN] * 12 for s in seqs)
    assert bm.num_used_blocks == 0


def test_preemption_prefers_lowest_priority_over_newest():
    sched, bm, _ = make(num_blocks=6, prefix=False)
    low = req("low", n=4, priority=5, max_tokens=12)
    hi1 = req("hi1", n=4, priority=0, start=30, max_tokens=12)
    hi2 = req("hi2", n=4, priority=0, start=60, max_tokens=12)
    for s in (low, hi1, hi2):
        sched.add(s)
    first_victim = None
    for _ in range(200):
        if not sched.has_unfinished:
            break
        step(sched)
        if first_victim is None and sched.num_preemptions:
            first_victim = [s.request_id for s in (low, hi1, hi2) if s.metrics.num_preemptions][0]
    assert first_victim == "low"
    assert all(s.is_finished and s.output_ids == [TOKEN] * 12 for s in (low, hi1, hi2))
    assert bm.num_used_blocks == 0


def test_preempted_sequence_reuses_its_prefix_blocks():
    sched, bm, _ = make(num_blocks=6, prefix=True)
    seqs = [req(r, n=8, start=10 * i, max_tokens=10) for i, r in enumerate("abc")]
    for s in seqs:
        sched.add(s)
    run_all(sched)
    assert sched.num_preemptions > 0
    assert bm.num_prefix_hits > 0                   # recompute started from cached blocks
    assert all(s.is_finished and s.output_ids == [TOKEN] * 10 for s in seqs)
    assert bm.num_used_blocks == 0


# --- priorities -------------------------------------------------------------------------------

def test_priority_then_fifo():
    sched, _, _ = make(max_batch_size=1)
    order = []
    for i, p in enumerate([1, 0, 2, 0, 1]):
        sched.add(req(f"r{i}p{p}", priority=p, start=10 * i, max_tokens=2))
    for _ in range(100):
        if not sched.has_unfinished:
            break
        batch, _ = step(sched)
        for s in batch.seqs:
            if s.seq.request_id not in order:
                order.append(s.seq.request_id)
    assert order == ["r1p0", "r3p0", "r0p1", "r4p1", "r2p2"]


def test_later_high_priority_request_admitted_before_earlier_low_priority():
    sched, _, _ = make(max_batch_size=1)
    sched.add(req("first", max_tokens=2))
    step(sched)
    sched.add(req("low", priority=3, start=40, max_tokens=1))
    sched.add(req("high", priority=-1, start=70, max_tokens=1))
    seen = []
    for _ in range(20):
        if not sched.has_unfinished:
            break
        batch, _ = step(sched)
        seen += [r for r in ids(batch) if r not in seen]
    assert seen == ["first", "high", "low"]


# --- finishing ---------------------------------------------------------------------------------

def scripted(script: list[int]) -> Callable[[Sequence], int]:
    return lambda seq: script[min(seq.num_output_tokens, len(script) - 1)]


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("case", ["eos", "ignore_eos", "stop_id", "stop_id_ignore_eos", "max_tokens"])
def test_finish_reasons(case, k):
    script = [5, 6, 2, 9, 8, 8, 8, 8, 8, 8]
    params = {"eos": {}, "ignore_eos": {"ignore_eos": True},
              "stop_id": {"stop_token_ids": [9]}, "stop_id_ignore_eos": {"stop_token_ids": [9], "ignore_eos": True},
              "max_tokens": {"max_tokens": 2}}[case]
    params.setdefault("max_tokens", 8)
    expect = {"eos": ([5, 6, 2], "stop"), "ignore_eos": (script[:8], "length"),
              "stop_id": ([5, 6, 2], "stop"), "stop_id_ignore_eos": ([5, 6, 2, 9], "stop"),
              "max_tokens": ([5, 6], "length")}[case]
    method = FakeMethod(k, next_token=scripted(script))
    sched, bm, _ = make(method=method)
    s = req("a", **params)
    sched.add(s)
    run_all(sched)
    assert (s.output_ids, s.finish_reason) == expect
    assert bm.num_used_blocks == 0 and method.finished == ["a"]


def test_max_model_len_finishes_with_length():
    sched, bm, _ = make(max_model_len=10)
    s = req("a", n=6, max_tokens=100)
    sched.add(s)
    run_all(sched)
    assert len(s.token_ids) == 10 and s.finish_reason == "length"


def test_logprobs_follow_committed_tokens():
    class WithLogprobs(FakeMethod):
        def commit(self, batch, out):
            commits = super().commit(batch, out)
            for c in commits:
                if c.token_ids:
                    c.logprobs = [{"token_id": t, "logprob": -1.0, "top": []} for t in c.token_ids]
            return commits
    method = WithLogprobs(2, next_token=scripted([4, 4, 4, 9, 4, 4, 4]))
    sched, _, _ = make(method=method)
    s, t = req("s", logprobs=0, stop_token_ids=[9], max_tokens=20), req("t", start=50)
    sched.add(s)
    sched.add(t)
    run_all(sched)
    assert s.output_ids == [4, 4, 4, 9]
    assert [e["token_id"] for e in s.logprobs] == s.output_ids   # none past the stop token
    assert t.logprobs == []                                      # not asked for


# --- speculative rollback -------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", [True, False])
def test_speculative_rollback_leaks_no_blocks(prefix):
    counter = iter(range(10 ** 6))
    method = FakeMethod(5, accept=lambda seq, extra: next(counter) % (extra + 1))
    sched, bm, _ = make(method=method, num_blocks=24, prefix=prefix, max_num_batched_tokens=24,
                        max_batch_size=4)
    seqs = [req(f"r{i}", n=5 + 3 * i, start=(i % 2) * 7, max_tokens=13 + i) for i in range(7)]
    for s in seqs:
        sched.add(s)
    batches = run_all(sched)
    assert any(s.num_extra for b in batches for s in b.seqs)
    assert all(s.is_finished and s.finish_reason == "length" for s in seqs)
    assert [s.num_output_tokens for s in seqs] == [13 + i for i in range(7)]
    assert all(s.block_table == [] for s in seqs)
    assert bm.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in bm.blocks)
    for h, bid in bm.cached.items():              # whatever stays cached is self-consistent
        assert bm.blocks[bid].hash == h


def test_speculative_step_needs_room_for_drafts():
    sched, _, _ = make(k=4, max_num_batched_tokens=8)
    a, b = req("a", n=3, max_tokens=6), req("b", n=3, start=40, max_tokens=6)
    sched.add(a)
    sched.add(b)
    step(sched)                                    # prefills: 3 + 3
    batch, _ = step(sched)
    assert ids(batch) == ["a"]                     # 1 + 4 fits, a second 1 + 4 does not
    assert batch.seqs[0].num_extra == 4
    run_all(sched)
    assert a.is_finished and b.is_finished


# --- abort ---------------------------------------------------------------------------------------

def test_abort_running_and_waiting_frees_blocks():
    sched, bm, method = make(max_batch_size=1)
    a, b = req("a", n=9, max_tokens=50), req("b", start=40)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    assert a in sched.running and bm.num_used_blocks > 0
    sched.abort(a)
    assert a.is_finished and a.finish_reason == "abort" and a.block_table == []
    assert bm.num_used_blocks == 0 and a not in sched.running
    sched.abort(b)
    assert b.is_finished and b.finish_reason == "abort" and not sched.has_unfinished
    assert method.finished == ["a", "b"]
    sched.abort(b)                                  # twice: harmless
    assert method.finished == ["a", "b"]


def test_abort_during_step_is_ignored_by_apply():
    sched, bm, method = make()
    a, b = req("a", max_tokens=5), req("b", start=40, max_tokens=5)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    method.prepare(batch)
    commits = method.commit(batch, None)
    sched.abort(a)                                  # e.g. client went away mid-forward
    changed = sched.apply(batch, commits)
    assert changed == [b]
    assert a.output_ids == [] and a.block_table == [] and a.finish_reason == "abort"
    check(sched)
    run_all(sched)
    assert bm.num_used_blocks == 0


# --- cache too small ---------------------------------------------------------------------------

@pytest.mark.parametrize("budget,prefix", [(2048, True), (16, True), (16, False), (8, True)])
def test_prompt_larger_than_cache_errors_instead_of_hanging(budget, prefix):
    sched, bm, _ = make(num_blocks=8, prefix=prefix, max_num_batched_tokens=budget)
    big = req("big", n=40, max_tokens=4)
    small = req("small", n=5, start=100, max_tokens=3)
    sched.add(big)
    sched.add(small)
    run_all(sched, max_steps=100)
    assert big.is_finished and big.finish_reason.startswith("error")
    assert big.block_table == []
    assert small.finish_reason == "length" and small.output_ids == [TOKEN] * 3
    assert bm.num_used_blocks == 0


def test_generation_outgrowing_cache_ends_instead_of_hanging():
    sched, bm, _ = make(num_blocks=4, max_num_batched_tokens=64)
    s = req("a", n=6, max_tokens=100)
    sched.add(s)
    run_all(sched, max_steps=200)
    assert s.is_finished and bm.num_used_blocks == 0


# --- prefix caching through the scheduler ---------------------------------------------------------

@pytest.mark.parametrize("max_tokens", [1, 3])
def test_finished_request_prompt_is_served_to_the_next(max_tokens):
    sched, bm, _ = make()
    a = req("a", n=13, max_tokens=max_tokens)
    sched.add(a)
    run_all(sched)
    b = req("b", n=13, max_tokens=2)
    sched.add(b)
    batch, _ = step(sched)
    assert batch.seqs[0].start_pos == 12 and batch.seqs[0].num_known == 1
    assert b.metrics.num_cached_prompt_tokens == 12
    run_all(sched)
    assert b.output_ids == [TOKEN, TOKEN] and bm.num_used_blocks == 0


def test_shared_prefix_between_running_requests():
    sched, bm, _ = make(max_num_batched_tokens=64)
    a = req("a", n=16, max_tokens=6)
    sched.add(a)
    step(sched)
    b = Sequence("b", list(range(10, 22)) + [90, 91, 92], SamplingParams(max_tokens=3))
    sched.add(b)
    batch, _ = step(sched)
    item = batch.seqs[ids(batch).index("b")]
    assert item.start_pos == 12 and b.block_table[:3] == a.block_table[:3]
    run_all(sched)
    assert a.output_ids == [TOKEN] * 6 and b.output_ids == [TOKEN] * 3
    assert bm.num_used_blocks == 0
