"""Continuous batching: requests join and leave the running batch at every step.

Each step: running sequences first (priority class, then arrival), each asking for its
uncomputed tokens plus the method's extra query slots; then waiting sequences are admitted
while the batch and the token budget allow, their prompts chunked to fit the budget. When
KV blocks run out, the least important, newest running sequence is preempted: its blocks are
freed and it waits to be recomputed from scratch (its output so far is kept as prompt).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from leapfrog.engine.block_manager import BlockManager
from leapfrog.methods.base import Batch, Commit, Method, ScheduledSeq
from leapfrog.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_batch_size: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    chunked_prefill: bool = True


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, method: Method,
                 eos_token_ids: list[int] | None = None) -> None:
        self.config = config
        self.bm = block_manager
        self.method = method
        self.eos_token_ids = set(eos_token_ids or [])
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.finished_outside_step: list[Sequence] = []   # aborted / failed, not via apply()
        self.num_preemptions = 0
        self.num_background_paused = 0      # background rows left out of a step for live work

    # --- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._finish(seq, reason)

    def _has_live(self) -> bool:
        return any(not s.background for s in self.running) or any(not s.background for s in self.waiting)

    @property
    def num_admissible(self) -> int:
        """Waiting sequences a next step could admit: background ones wait while live work runs
        (the decode loop cuts its call short only for these)."""
        if any(not s.background for s in self.running):
            return sum(not s.background for s in self.waiting)
        return len(self.waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step -----------------------------------------------------------------------
    def schedule(self) -> Batch:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        self.running.sort(key=lambda s: s.sort_key)
        live = self._has_live()
        for seq in list(self.running):
            if seq not in self.running:          # preempted to make room for another
                continue
            if live and seq.background:         # paused while live requests run (kept in the cache)
                self.num_background_paused += 1
                continue
            if self._share(seq, budget) is None:
                continue                         # no token budget left for it this step
            item = self._fit(seq, budget)
            while item is None and seq in self.running:
                self._preempt(self._victim(exclude={s.seq for s in scheduled}))
                item = self._fit(seq, budget) if seq in self.running else None
            if item is not None:
                scheduled.append(item)
                budget -= item.num_query
        self._admit(scheduled, budget)
        return Batch(scheduled, self.method.attn_block_size, self.method.capture_layers,
                     self.method.attn_bidir_token)

    def _share(self, seq: Sequence, budget: int) -> tuple[int, int] | None:
        """(known, extra) query tokens for `seq` under the budget, or None if none fit.

        The method's extra slots come whole, after every known token; a method asks for them
        once at most `Method.max_known_with_extra` known tokens are left (default 1: the last
        sampled token). Otherwise the known tokens are chunked, and a chunk ends on the
        attention-block grid, where its KV no longer depends on later tokens of its block."""
        known = seq.num_uncomputed
        ask = known <= self.method.max_known_with_extra
        extra = self.method.num_extra_tokens(seq) if ask else 0
        if known + extra <= budget:
            return known, extra
        if not self.config.chunked_prefill or budget <= 0 or (extra and known <= 1):
            return None
        end = seq.num_computed + min(known, budget)
        end -= end % self.method.attn_block_size
        return (end - seq.num_computed, 0) if end > seq.num_computed else None

    def _fit(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        """Reserve KV for `seq`'s share of this step; None if the budget or cache is short."""
        share = self._share(seq, budget)
        if share is None or not self.bm.reserve(seq, seq.num_computed + sum(share)):
            return None
        return ScheduledSeq(seq, seq.num_computed, *share)

    def _victim(self, exclude: set[Sequence]) -> Sequence:
        candidates = [s for s in self.running if s not in exclude]   # never empty: holds the asker
        return max(candidates, key=lambda s: s.sort_key)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        self.method.on_finished(seq)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)

    def _admit(self, scheduled: list[ScheduledSeq], budget: int) -> None:
        self.waiting.sort(key=lambda s: s.sort_key)
        live = self._has_live()
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if live and seq.background:         # background work waits while live work exists
                break
            if len(self.running) >= self.config.max_batch_size:
                idle = [s for s in self.running if s.background and not seq.background]
                if not idle:
                    break
                self._preempt(max(idle, key=lambda s: s.sort_key))   # a paused background row makes room
                continue
            if not self._fits_at_all(seq):       # would preempt itself forever: give up
                self.waiting.pop(0)
                self._finish(seq, "error:kv_cache_too_small")
                continue
            if not seq.block_table:
                seq.num_computed = self.bm.match_prefix(seq)
                seq.metrics.num_cached_prompt_tokens = seq.num_computed
            item = self._fit(seq, budget)
            idle = [s for s in self.running if s.background] if item is None and not seq.background else []
            if item is None and idle:            # paused background rows hold the cache: one makes room
                self.bm.free_seq(seq)
                seq.num_computed = 0
                self._preempt(max(idle, key=lambda s: s.sort_key))
                continue
            if item is None:
                self.bm.free_seq(seq)            # give back prefix hits; retry next step
                seq.num_computed = 0
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            scheduled.append(item)
            budget -= item.num_query

    def _fits_at_all(self, seq: Sequence) -> bool:
        """Whether the whole cache could hold `seq` plus one new token."""
        return -(-(len(seq.token_ids) + 1) // self.bm.block_size) <= self.bm.num_blocks

    # --- after the forward ---------------------------------------------------------------
    def apply(self, batch: Batch, commits: list[Commit]) -> list[Sequence]:
        """Append committed tokens, roll back unkept KV, finish sequences; returns the
        sequences that changed (got tokens or finished)."""
        changed = []
        now = time.perf_counter()
        for item, commit in zip(batch.seqs, commits):
            seq = item.seq
            if seq.is_finished:                  # aborted during the step
                continue
            seq.num_computed = item.start_pos + commit.num_kv_keep
            self.bm.truncate(seq, seq.num_computed)
            if commit.counted_forward:
                seq.metrics.num_forwards += commit.forwards
            if not commit.token_ids:
                self.bm.register_full_blocks(seq)
                continue
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            self._append(seq, commit)
            self.bm.register_full_blocks(seq)
            changed.append(seq)
        return changed

    def _append(self, seq: Sequence, commit: Commit) -> None:
        p = seq.params
        for i, token in enumerate(commit.token_ids):
            seq.token_ids.append(token)
            if commit.logprobs is not None and p.logprobs is not None:
                seq.logprobs.append(commit.logprobs[i])
            reason = None
            if token in p.stop_token_ids:
                reason = "stop"
            elif not p.ignore_eos and token in self.eos_token_ids:
                reason = "stop"
            elif seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.config.max_model_len:
                reason = "length"
            if reason:
                self.finish(seq, reason)
                return

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        if reason.startswith("error") or reason == "abort":
            self.finished_outside_step.append(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = time.perf_counter()
        self.bm.register_full_blocks(seq)        # blocks completed by the final step stay cached
        self.bm.free_seq(seq)
        self.method.on_finished(seq)
