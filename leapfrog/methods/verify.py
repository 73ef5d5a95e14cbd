"""Verification policies: how many of a request's drafts the target checks in the next step
(`fixed`, `threshold`, DSpark's `confidence` scheduler), decided without seeing the sampled
drafts, so verification stays lossless. The call order and the pricing: docs/architecture.md,
"The methods in detail"."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from leapfrog.layers.parallel import broadcast_object, shared_clock, world_size
from leapfrog.methods.confidence_schedule import (AcceptanceFeedback, MeasuredCost, StepCostTable,
                                                  schedule_prefix, survival)

VERIFY_MODES = ("fixed", "threshold", "confidence")


def _now() -> float:
    """The policies' clock: this process's, or rank 0's when several ranks run one engine (each
    rank then decides as rank 0 does, and their schedules stay the same)."""
    return shared_clock(time.perf_counter())


@dataclass(slots=True)
class VerifyRecord:
    """What a verify policy keeps of one request (only confidence scheduling keeps anything)."""
    feedback: AcceptanceFeedback = field(default_factory=AcceptanceFeedback)
    prediction: list[float] | None = None     # survival row, smoothed over the request's steps


class VerifyPolicy:
    """The interface, with the defaults of a policy that verifies every draft and learns
    nothing from timing or feedback."""
    name = "fixed"
    needs_confidence = False          # whether num_to_verify reads the drafter's confidences
    # Whether drafting costs per drafted token (an AR draft model, which the method tells
    # end_drafting the drafts of) rather than per request (a parallel drafter's block).
    draft_cost_per_token = False

    def should_draft(self, records: list[VerifyRecord], batch: int | None = None) -> bool:
        """Whether the next step, of `batch` requests (default: as many as records), drafts
        for these requests (drafting costs time even when none of its drafts is verified)."""
        return True

    def draft_lengths(self, records: list[VerifyRecord], gamma: int) -> list[int]:
        """How many drafts each request should draft, at most `gamma`, for a drafter whose
        cost grows with each draft (an AR draft model; a parallel drafter drafts its block)."""
        return [gamma] * len(records)

    def begin_drafting(self) -> None:
        """Drafting starts (after the context projection, which is paid whenever it happens)."""

    def num_to_verify(self, records: list[VerifyRecord], confidences: list[list[float] | None],
                      num_drafts: list[int]) -> list[int | None]:
        """Drafts to verify per request (None: all of them)."""
        return [None] * len(records)

    def end_drafting(self, num_requests: int) -> None:
        """Drafting for `num_requests` requests (or, drafting costing per token, that many
        drafts) is done."""

    def next_step(self) -> None:
        """The step's drafting, or the decision not to draft, is done."""

    def drafted_anyway(self, verifies: bool) -> None:
        """For a drafter that costs nothing (`ngram`), which drafts at every step without asking
        should_draft: whether the next step verifies drafts, so that its time is measured as a
        verify step or as a plain one."""

    def beats_plain(self, records: list[VerifyRecord], confidences: list[list[float] | None],
                    lengths: list[int | None], batch: int) -> bool:
        """For such a drafter: whether verifying `lengths` drafts of these requests (in a next
        step of `batch` requests) beats a plain step, which a batch without drafts takes in the
        C++ decode loop."""
        return True

    def observe_step(self, num_tokens: int, decode_only: bool = True) -> None:
        """A step of `num_tokens` query tokens finished its forward and verification;
        `decode_only`: every row was a request's next token and its drafts (no prompt chunk)."""

    def steps_without_drafting(self, batch: int) -> int:
        """How many steps, the one about to run included, will certainly not draft for a batch
        of `batch` requests (0: unknown, or the next step may draft): those may run in the C++
        decode loop."""
        return 0

    def dormant(self, batch: int) -> bool:
        """Whether the last decision found that drafting for `batch` requests could not pay
        even if every draft were accepted (until the next decision the drafter then needs no
        context: the decode loop captures no target features for it)."""
        return False

    def stays_dormant(self, records: list[VerifyRecord], batch: int) -> bool:
        """Whether, dormant, drafting for these requests still could not pay for a next step of
        `batch` requests; if so that is the decision for it (no draft). Asked instead of
        should_draft when no request has the drafter context a draft needs (it lapsed while
        dormant)."""
        return False

    def skipped_in_loop(self, steps: int, batch: int) -> None:
        """`steps` steps of `batch` requests ran in the decode loop without drafting (the first
        of them decided by the last should_draft), not decided one by one."""

    def observe(self, record: VerifyRecord, confidence: list[float], num_verified: int,
                num_accepted: int) -> None:
        """What verification showed for drafts whose confidences were `confidence`."""

    def stats(self) -> dict[str, float]:
        return {}


class FixedPolicy(VerifyPolicy):
    """`fixed`: every draft is verified; the drafter's confidence head is not even run."""
    name = "fixed"


class ThresholdPolicy(VerifyPolicy):
    """`threshold`: the longest prefix whose survival Π c_i stays >= threshold."""
    name = "threshold"
    needs_confidence = True

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def num_to_verify(self, records: list[VerifyRecord], confidences: list[list[float] | None],
                      num_drafts: list[int]) -> list[int | None]:
        return [self.prefix(c) for c in confidences]

    def prefix(self, confidence: list[float] | None) -> int | None:
        if confidence is None:        # a drafter without a confidence head: verify all
            return None
        surv, n = 1.0, 0
        for c in confidence:
            surv *= c
            if surv < self.threshold:
                break
            n += 1
        return n


class ConfidencePolicy(VerifyPolicy):
    """`confidence`: DSpark's Algorithm 1 on survival rows corrected by each request's feedback
    (AcceptanceFeedback), priced by the step and drafting costs this engine measures
    (MeasuredCost over a start-up profile, or over `step_costs` when given). Before drafting it
    decides whether the step drafts at all; after declining it re-probes, the wait doubling
    while drafting does not pay, and probes take at most `probe_budget` of the wall time.
    (docs/architecture.md, "Verification policies")"""
    name = "confidence"
    needs_confidence = True
    reprobe_steps = 16
    max_reprobe_steps = 256
    min_gain = 1.1
    probe_gain = 1.5              # probes only where perfect drafts would beat plain steps by this
    probe_budget = 0.03

    def __init__(self, step_costs: StepCostTable | None = None,
                 profile: Callable[[], StepCostTable] | None = None) -> None:
        self.step_costs = step_costs          # Algorithm 1's SPS curve: given, or profiled on first use
        self.measured: MeasuredCost | None = None    # step and drafting costs as measured
        self.prior: list[float] | None = None        # running average survival row (all requests)
        self.num_drafts = 0                   # drafting calls so far (the first is a warm-up, not timed)
        self._profile = profile
        self._skipped_steps = 0               # consecutive steps that skipped drafting
        self._reprobe_every = self.reprobe_steps     # set per batch size once drafting has paid
        self._waits: dict[int, int] = {}      # batch size -> the wait last set there
        self._decided_batch = -1              # batch size of the last drafting decision
        self._probing = False                 # this step drafts only to re-probe: verify >= 1 draft each
        self._step_end: float | None = None   # when the previous step's verification ended
        self._next_kind: str | None = None    # what the next step is, as decided: "verify" or "plain"
        self._draft_start = 0.0
        self._probe_start = 0.0
        self._probe_cost: float | None = None  # seconds of a probe's drafting (context projection included)
        self._last_probe_end = 0.0
        self._dormant = False                 # the last decision: drafting could not pay at all

    @property
    def reprobe_wait(self) -> int:
        """Skipped steps before the next re-probe, at the batch size last decided for."""
        return self._reprobe_every

    @property
    def probing(self) -> bool:
        """This step drafts only to re-probe."""
        return self._probing

    def cost_model(self) -> MeasuredCost:
        """Step and drafting costs: measured, the profile filling in the rest (profiled once,
        on first use)."""
        if self.measured is None:
            if self.step_costs is None:
                if self._profile is None:
                    raise ValueError("confidence scheduling: no step_costs given and no model to profile")
                self.step_costs = self._profile()
                if world_size() > 1:      # every rank prices steps by rank 0's profile
                    self.step_costs = broadcast_object(self.step_costs)
            self.measured = MeasuredCost(self.step_costs)
            self.measured.draft.through_origin = self.draft_cost_per_token
        return self.measured

    def should_draft(self, records: list[VerifyRecord], batch: int | None = None) -> bool:
        """A request's survival row from its previous drafts (smoothed), or the running average
        for a request that has none yet, stands in for confidences not drawn yet; the step
        drafts when the expected tokens per second of the best schedule on those predictions,
        drafting time included, beat a plain decode step's by min_gain (10%: predictions and
        costs are estimates). The decision is for the whole batch (drafting's cost is mostly
        per step, not per request) and, once negative, holds while the batch size does, until
        the next re-probe."""
        self._next_kind = "verify"
        if self.measured is None or not self.measured.draft.num_samples or self.prior is None:
            # nothing measured yet: draft, priced as a probe (its cost sets the probe budget's pace)
            self._probe_start, self._probing = _now(), True
            return True
        # The decision holds for the next step's size (a request finishing now leaves it; one
        # with one token left stays in it, drafted for or not), which steps_without_drafting
        # is asked about.
        batch = len(records) if batch is None else batch
        if batch != self._decided_batch:
            self._decided_batch = batch
            # Back at a batch size seen before: its own wait (with a few requests at the end of
            # a burst drafting pays and the wait restarts short; the next burst would otherwise
            # probe whole batches after 6, 12, 24, ... steps again). First visit: keep the wait.
            self._reprobe_every = self._waits.get(batch, self._reprobe_every)
        elif 0 < self._skipped_steps < self._reprobe_every:
            return self._skip()           # same load, decided already: no need to re-plan
        pays = self._drafting_pays(records)
        self._dormant = not pays and not self._could_pay(batch)
        if self._dormant:
            # Not even drafts that were all accepted would pay enough at these costs: a probe
            # could find a marginal gain at most. Wait the longest, then look at the costs again.
            return self._sleep(batch)
        if pays:
            self._skipped_steps, self._reprobe_every = 0, self.first_wait(batch)
            self._waits[batch] = self._reprobe_every
            return True
        if self._skipped_steps >= self._reprobe_every:      # probe, then wait longer
            wait = self._probe_wait(batch)
            if wait > 0:                  # over the probe budget: skip on, the loop may run them
                self._reprobe_every = self._skipped_steps + wait
                return self._skip()
            self._probe_start = _now()
            self._skipped_steps = 0
            self._reprobe_every = self._waits[batch] = min(2 * self._reprobe_every, self.max_reprobe_steps)
            self._probing = True
            return True
        return self._skip()

    def _drafting_pays(self, records: list[VerifyRecord]) -> bool:
        """Whether the predicted tokens per second of drafting and verifying the best schedule
        beat a plain decode step's by min_gain."""
        return self._pays([r.prediction or self.prior for r in records])

    def _could_pay(self, batch: int) -> bool:
        """Whether drafting for `batch` requests would beat plain steps by probe_gain if every
        draft were accepted: the bound on what a probe can find, which must be worth the
        probes' cost. On a model whose step costs little next to a verify step and drafting,
        such as one that sits in the CPU's caches, it is not, and its probes (plus the drafter's
        features captured at every step) would cost time for nothing."""
        if self.prior is None or self.measured is None or not self.measured.draft.num_samples:
            return True
        return self._pays([[1.0] * len(self.prior)] * batch, self.probe_gain)

    def _pays(self, preds: list[list[float]], gain_needed: float = 0.0) -> bool:
        """Whether the best schedule on `preds` beats plain steps by gain_needed (default:
        min_gain)."""
        batch = len(preds)
        table = self.cost_model()
        step = self._planned_step(table, batch)
        lengths = schedule_prefix(preds, lambda b: 1.0 / step(b))
        gain = sum(sum(row[:n]) for row, n in zip(preds, lengths))
        with_drafts = (batch + gain) / step(batch + sum(lengths))
        return with_drafts > (gain_needed or self.min_gain) * batch / table.plain_cost(batch)

    def _planned_step(self, table: MeasuredCost, batch: int) -> Callable[[int], float]:
        """Seconds of a step verifying b - batch drafts, drafting included: drafting costs
        per request, or per drafted token, where a request drafts one past what it verifies
        (draft_lengths), b tokens in all."""
        if self.draft_cost_per_token:
            return lambda b: table.cost(b) + table.draft(b)
        overhead = table.draft(batch)
        return lambda b: table.cost(b) + overhead

    def _probe_wait(self, batch: int) -> int:
        """Skipped steps until a probe fits the probe budget (0: it fits now): its measured
        drafting cost plus the verify step it adds, against the time since the last probe."""
        if self._probe_cost is None or self.measured is None:
            return 0
        table = self.measured
        plain = table.plain_cost(batch)
        cost = self._probe_cost + max(0.0, table.cost(2 * batch) - plain)
        left = self._last_probe_end + cost / self.probe_budget - _now()
        return 0 if left <= 0 else min(self.max_reprobe_steps, int(left / plain) + 1)

    def first_wait(self, batch: int) -> int:
        """Skipped steps before the first re-probe after drafting paid: reprobe_steps from 8
        requests on, proportionally fewer below. With few requests the predictions swing from
        step to step (one hard spot in one text), a probe costs little next to what drafting
        gains when it pays, and the doubling still bounds the probes when it never pays."""
        return max(1, min(self.reprobe_steps, self.reprobe_steps * batch // 8))

    def _skip(self) -> bool:
        self._skipped_steps += 1
        self._next_kind = "plain"
        return False

    def draft_lengths(self, records: list[VerifyRecord], gamma: int) -> list[int]:
        """One more than the best schedule on each request's predicted survival row (extended
        to γ positions at its last conditional rate) would verify, at most γ: the extra draft
        lets a row whose drafts keep being accepted grow. All γ while nothing is measured, and
        on a probe (it refreshes the predictions). Priced by the target's step costs and the
        measured drafting cost (_planned_step)."""
        if self.measured is None or self.prior is None or self._probing or not self.measured.draft.num_samples:
            return [gamma] * len(records)
        table = self.cost_model()
        step = self._planned_step(table, len(records))
        rows = [extend_row(r.prediction or self.prior, gamma) for r in records]
        lengths = schedule_prefix(rows, lambda b: 1.0 / step(b))
        return [min(gamma, n + 1) for n in lengths]

    def begin_drafting(self) -> None:
        if self.measured is None:
            # Profiled once, before the drafting clock starts; nor is it part of what a probe
            # costs (seconds of it would otherwise pace the probes minutes apart).
            self.cost_model()
            if self._probing:
                self._probe_start = _now()
        self._draft_start = _now()

    def num_to_verify(self, records: list[VerifyRecord], confidences: list[list[float] | None],
                      num_drafts: list[int]) -> list[int | None]:
        """Seconds per step = verify step at B tokens + drafting, whose cost does not depend on
        how many drafts are verified (both as measured). Survival rows are corrected by what
        verification showed for each request so far."""
        table = self.cost_model()
        # Drafting is done: its cost, a constant now, still weighs against the verify step's.
        overhead = table.draft(sum(num_drafts) if self.draft_cost_per_token else len(records))
        rows = [r.feedback.correct(survival(c or [])) for r, c in zip(records, confidences)]
        lengths = schedule_prefix(rows, lambda b: 1.0 / (table.cost(b) + overhead))
        if self._probing:                 # a re-probe learns nothing unless something is verified
            lengths = [max(n, min(1, k)) for n, k in zip(lengths, num_drafts)]
        for r, row in zip(records, rows):
            # The prediction should_draft uses next time: survival rows, smoothed over steps.
            r.prediction = blend_rows(r.prediction, row, 0.5)
            self.prior = blend_rows(self.prior, row, 0.1)
        return lengths

    def end_drafting(self, num_requests: int) -> None:
        spent = _now() - self._draft_start
        self.num_drafts += 1
        if self.num_drafts > 1 and self.measured is not None:   # the first pays one-off allocations
            self.measured.draft.add(num_requests, spent)

    def next_step(self) -> None:
        now = _now()
        if self._probing:
            # The first drafting call pays one-off allocations: not what a probe costs.
            if self.num_drafts > 1:
                cost = now - self._probe_start
                self._probe_cost = cost if self._probe_cost is None else 0.5 * (self._probe_cost + cost)
            self._last_probe_end = now
        self._probing = False
        self._step_end = now                      # the next step's clock starts after drafting

    def drafted_anyway(self, verifies: bool) -> None:
        self._next_kind = "verify" if verifies else "plain"

    def beats_plain(self, records: list[VerifyRecord], confidences: list[list[float] | None],
                    lengths: list[int | None], batch: int) -> bool:
        """Expected tokens per second of the step with these drafts verified (the survival rows
        corrected as num_to_verify corrects them) against a plain step's, by min_gain."""
        table = self.cost_model()
        if not table.num_plain_samples:
            return True                   # no plain step measured yet: nothing to set against
        verified = [len(c or []) if n is None else n for n, c in zip(lengths, confidences)]
        if not sum(verified):
            return False
        rows = [r.feedback.correct(survival(c or [])) for r, c in zip(records, confidences)]
        gain = sum(sum(row[:n]) for row, n in zip(rows, verified))
        with_drafts = (batch + gain) / (table.cost(batch + sum(verified)) + table.draft(len(records)))
        return with_drafts > self.min_gain * batch / table.plain_cost(batch)

    def dormant(self, batch: int) -> bool:
        """The last decision, for this batch size, found that drafting could not pay even if
        every draft were accepted: until the next decision, the drafter needs no context."""
        return self._dormant and batch == self._decided_batch

    def stays_dormant(self, records: list[VerifyRecord], batch: int) -> bool:
        if not self._dormant:
            return False
        if batch == self._decided_batch and 0 < self._skipped_steps < self._reprobe_every:
            self._skip()                  # decided for this size already (as should_draft)
            return True
        if self._could_pay(batch) or self._drafting_pays(records):
            return False
        self._decided_batch = batch
        self._sleep(batch)
        return True

    def _sleep(self, batch: int) -> bool:
        """Skip, dormant for `batch` requests until the longest wait is over."""
        self._skipped_steps = 0
        self._reprobe_every = self._waits[batch] = self.max_reprobe_steps
        return self._skip()

    def steps_without_drafting(self, batch: int) -> int:
        """After a decision to skip, at the same batch size, the steps until the re-probe."""
        if batch != self._decided_batch or not 0 < self._skipped_steps < self._reprobe_every:
            return 0
        return self._reprobe_every - self._skipped_steps + 1

    def skipped_in_loop(self, steps: int, batch: int) -> None:
        """The loop's steps are what a plain decode step costs now: priced as their mean."""
        now = _now()
        if self._step_end is not None and self.measured is not None and steps > 0:
            self.measured.observe_plain(batch, (now - self._step_end) / steps)
        self._skipped_steps += steps - 1
        self._step_end = now
        self._next_kind = None

    def observe_step(self, num_tokens: int, decode_only: bool = True) -> None:
        """Time the step just run (from the end of the previous step's verification, or of its
        drafting: scheduling, the forward, sampling, verification; not drafting, which is timed
        on its own) and fit the cost model to it: as a verify step when the last decision
        drafted, as a plain step when it decided not to. Steps no decision chose are no samples:
        a request's last step (nothing left to draft for), a step with a prompt chunk in it (its
        cost is the prompt's; the first step of a request also follows the engine's idle gap)."""
        now = _now()
        kind, self._next_kind = self._next_kind, None
        if self._step_end is not None and self.measured is not None and decode_only:
            if kind == "verify":
                self.measured.observe(num_tokens, now - self._step_end)
            elif kind == "plain":
                self.measured.observe_plain(num_tokens, now - self._step_end)
        self._step_end = now

    def observe(self, record: VerifyRecord, confidence: list[float], num_verified: int,
                num_accepted: int) -> None:
        record.feedback.observe(survival(confidence), num_verified, num_accepted)

    def stats(self) -> dict[str, float]:
        m = self.measured
        return {"num_drafts": self.num_drafts, "reprobe_wait": self._reprobe_every,
                "num_step_samples": m.num_samples if m is not None else 0,
                "num_plain_step_samples": m.num_plain_samples if m is not None else 0}


def blend_rows(old: list[float] | None, new: list[float], weight: float) -> list[float]:
    """(1 - weight) * old + weight * new over the positions both rows have; past the shorter,
    the longer row's values; kept non-increasing (a survival row). Rows are as long as the
    drafts they came from, which an AR draft model varies from step to step."""
    if not old:
        return list(new)
    n = min(len(old), len(new))
    row = [(1 - weight) * x + weight * y for x, y in zip(old, new)] + (new[n:] if len(new) > n else old[n:])
    for j in range(1, len(row)):
        row[j] = min(row[j], row[j - 1])
    return row


def extend_row(row: list[float], length: int) -> list[float]:
    """A survival row cut or extended to `length` positions, each further position at the
    row's last conditional rate (a_j / a_{j-1})."""
    row = list(row[:length])
    rate = row[-1] / row[-2] if len(row) > 1 and row[-2] > 0 else (row[-1] if row else 0.5)
    while len(row) < length:
        row.append((row[-1] if row else 1.0) * rate)
    return row


def make_policy(verify: str, threshold: float = 0.7, step_costs: dict | None = None,
                profile: Callable[[], StepCostTable] | None = None) -> VerifyPolicy:
    """The policy a speculative method's `verify` option names. `step_costs` ({batch tokens:
    seconds}) replaces confidence scheduling's start-up profile, which `profile` runs."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r}: expected one of {', '.join(VERIFY_MODES)}")
    try:          # a number, or its text (a config file's string)
        value = float(threshold) if not isinstance(threshold, bool) else math.nan
    except (TypeError, ValueError):
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"threshold={threshold!r}: must be a number between 0 and 1 (a draft's confidence)")
    threshold = value
    table = StepCostTable.from_mapping(step_costs) if step_costs else None
    if verify == "fixed":
        return FixedPolicy()
    if verify == "threshold":
        return ThresholdPolicy(threshold)
    return ConfidencePolicy(table, profile)
