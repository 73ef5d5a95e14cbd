"""Speculative decoding: a drafter proposes tokens after each verify, the target verifies them in
one forward with the shared acceptance rule (sample/rejection.py). How steps, drafting and the
verify policy fit together: docs/architecture.md, "The methods in detail"."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from leapfrog.methods.base import Batch, Commit, Method, ScheduledSeq, StepOutput
from leapfrog.methods.verify import FixedPolicy, VerifyPolicy, VerifyRecord
from leapfrog.sample.rejection import greedy_accept, verify_drafts
from leapfrog.sample.sampler import Sampler, penalize_drafted_rows, token_logprobs
from leapfrog.sequence import Sequence

if TYPE_CHECKING:
    from leapfrog.methods.base import MethodContext
    from leapfrog.models.dflash import DraftContext


@dataclass(slots=True)
class Proposal:
    """Drafts for the token after `anchor_pos` (the last committed position)."""
    anchor_pos: int
    token_ids: list[int]
    probs: torch.Tensor | None = None          # [k, V] draft distribution q; None: one-hot (argmax drafts)
    confidence: list[float] | None = None      # per-position conditional acceptance estimates (DSpark's confidence head)
    num_verify: int | None = None              # how many drafts to verify (the verify policy's); None: all


@dataclass(slots=True)
class Anchor:
    """A sequence whose next step verifies drafts that start after `token_id` at `pos`.
    Proposals are made before Scheduler.apply appends this step's tokens: the sequence then
    reads seq.token_ids + new_token_ids (whose last entry is the anchor)."""
    seq: Sequence
    token_id: int
    pos: int
    new_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SpecState:
    """A speculative request's record between steps (its Sequence.method_state). on_finished()
    releases the drafts, the drafter's context and the policy's record; τ's counters and the
    fallback flag stay (metrics read τ after the request finished; a preempted request keeps
    them)."""
    proposal: Proposal | None = None           # drafts for the next step
    context: "DraftContext | None" = None      # the drafter's K/V of the request's kept positions
    verify: VerifyRecord = field(default_factory=VerifyRecord)   # what the verify policy learned of it
    num_verify_steps: int = 0
    num_emitted_tokens: int = 0                # accepted + bonus over all verify steps
    num_drafted_tokens: int = 0                # drafts verified, over all verify steps
    drafting_off: bool = False                 # fallback: acceptance collapsed, decode as ar

    def release(self) -> None:
        self.proposal, self.context, self.verify = None, None, VerifyRecord()


@dataclass(slots=True)
class SpecCounters:
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    num_fallbacks: int = 0                                  # requests that stopped drafting
    num_skipped_drafts: int = 0                             # request-steps not drafted (not worth it under load)
    num_requests_drafting_off: int = 0                      # finished requests that asked for no drafting
    drafted_at: list[int] = field(default_factory=list)    # per draft position (0-based)
    accepted_at: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafted_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_verify_steps += 1
        grow = num_drafted - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for j in range(num_drafted):
            self.drafted_at[j] += 1
            self.accepted_at[j] += j < num_accepted

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {"num_drafted_tokens": self.num_drafted_tokens,
                                 "num_accepted_tokens": self.num_accepted_tokens,
                                 "num_verify_steps": self.num_verify_steps,
                                 "num_fallbacks": self.num_fallbacks,
                                 "num_skipped_drafts": self.num_skipped_drafts,
                                 "num_requests_drafting_off": self.num_requests_drafting_off}
        if self.num_verify_steps:
            out["acceptance_length"] = 1 + self.num_accepted_tokens / self.num_verify_steps
        for j, (d, a) in enumerate(zip(self.drafted_at, self.accepted_at)):
            out[f"acceptance_rate_pos{j + 1}"] = a / d if d else 0.0
        return out


def check_num_speculative_tokens(value: object) -> int:
    """The `num_speculative_tokens` option: an integer >= 0 (a ValueError naming it otherwise)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"num_speculative_tokens={value!r}: must be an integer >= 0")
    return value


class SpeculativeMethod(Method):
    """Lossless draft-and-verify; subclasses supply the drafter (and may set a verify policy)."""
    name = "speculative"

    # fallback="ar" or "parallel": a request whose τ stays below fallback_tau after fallback_min_steps verify
    # steps stops drafting (acceptance collapse must not cost more than ar).
    fallback_min_steps = 8
    fallback_tau = 1.2

    def __init__(self, ctx: "MethodContext", num_speculative_tokens: int = 4,
                 fallback: str = "none", policy: VerifyPolicy | None = None) -> None:
        check_num_speculative_tokens(num_speculative_tokens)
        if fallback not in ("none", "ar", "parallel"):
            raise ValueError(f"fallback={fallback!r}: expected none, ar or parallel")
        self.fallback = fallback
        self.ctx = ctx
        self.sampler: Sampler = ctx.sampler
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.max_step_tokens = 1 + self.num_speculative_tokens    # the last token and its drafts
        self.max_positions = int(getattr(ctx.model, "config", {}).get("max_position_embeddings", 1 << 30))
        self.counters = SpecCounters()
        self.policy: VerifyPolicy = policy or FixedPolicy()

    # --- drafter hooks (subclasses) --------------------------------------------------------
    def observe(self, batch: Batch, out: StepOutput, commits: list[Commit]) -> None:
        """Take the captured target hidden states of each sequence's kept query rows."""

    def propose(self, anchors: list[Anchor]) -> list[Proposal]:
        """Draft up to num_speculative_tokens tokens after each anchor."""
        return [Proposal(a.pos, []) for a in anchors]

    # --- Method ----------------------------------------------------------------------------
    @staticmethod
    def state(seq: Sequence) -> SpecState:
        """The sequence's SpecState, made on first use."""
        if seq.method_state is None:
            seq.method_state = SpecState()
        return seq.method_state

    def num_extra_tokens(self, seq: Sequence) -> int:
        st: SpecState | None = seq.method_state
        prop = st.proposal if st is not None else None
        if prop is None or prop.anchor_pos != len(seq.token_ids) - 1:
            return 0
        k = len(prop.token_ids) if prop.num_verify is None else prop.num_verify
        cap = seq.params.num_speculative_tokens
        if cap is not None:
            k = min(k, cap)
        remaining = seq.params.max_tokens - seq.num_output_tokens - 1   # the bonus is always free
        room = self.max_positions - len(seq.token_ids)                  # last query position < max
        k = max(0, min(k, remaining, room))
        if k and seq.grammar is not None:
            k = self._grammar_prefix(seq, prop.token_ids[:k])
        return k

    @staticmethod
    def _grammar_prefix(seq: Sequence, drafts: list[int]) -> int:
        """Drafts worth verifying under the request's constraint: those it allows in a row, and
        for a sampled request the first one it rejects too (that row's residual draw keeps
        verification lossless; the target gives that draft probability 0). Greedy requests
        stop before it: the masked argmax is never that draft."""
        valid = seq.grammar.num_valid(seq.output_ids, drafts)
        return valid if seq.params.greedy else min(len(drafts), valid + 1)

    def prepare(self, batch: Batch) -> None:
        for s in batch.seqs:
            known = s.seq.token_ids[s.start_pos:s.start_pos + s.num_known]
            drafts = s.seq.method_state.proposal.token_ids[:s.num_extra] if s.num_extra else []
            s.query_ids = known + drafts
            s.num_logits = (1 + s.num_extra) if s.reaches_end else 0

    def commit(self, batch: Batch, out: StepOutput) -> list[Commit]:
        commits = self._verify(batch, out)
        self.observe(batch, out, commits)
        self.policy.observe_step(batch.num_tokens, all(s.num_known == 1 for s in batch.seqs))
        self._plan_next(batch, commits)
        return commits

    def _plan_next(self, batch: Batch, commits: list[Commit]) -> None:
        """Draft (or decide not to) after each request's last committed token, for the
        requests this commit does not finish."""
        going = [(s, c) for s, c in zip(batch.seqs, commits) if not s.seq.finishes_with(c.token_ids)]
        wanting = [Anchor(s.seq, c.token_ids[-1], len(s.seq.token_ids) + len(c.token_ids) - 1, c.token_ids)
                   for s, c in going if c.token_ids and self._wants_drafts(s.seq, c)]
        # A request whose drafter context stops short of its anchor (the decode loop captured no
        # features while drafting could not pay) decodes one more step plainly: its features are
        # captured again, into a fresh context, before its next draft.
        anchors = [a for a in wanting if self._context_reaches(a.seq, a.pos)]
        # The decision is for the next step's batch, `going` (a request with one token left
        # stays in it undrafted): keyed by another size, the loop would not take that step.
        if anchors:
            for a, prop in zip(anchors, self._proposals(anchors, len(going))):
                self.state(a.seq).proposal = prop
        elif wanting and self.policy.stays_dormant([self.state(a.seq).verify for a in wanting], len(going)):
            # No context reaches because drafting could not pay, and at this size it still
            # cannot: that is the decision, and the loop goes on (else a plain step first).
            self.counters.num_skipped_drafts += len(wanting)
            self.policy.next_step()

    def loop_steps(self, batch: Batch) -> int:
        """Steps the policy has decided not to draft in run in the C++ decode loop, for greedy
        requests (the loop's sampler draws other random numbers than verification's)."""
        if not all(s.seq.params.greedy and s.seq.params.loop_samples for s in batch.seqs):
            return 0
        return self.policy.steps_without_drafting(len(batch.seqs))

    def loop_capture_layers(self, batch: Batch) -> tuple[int, ...]:
        """None while the policy finds that drafting could not pay at all: the drafter's
        context then misses those positions, and the next draft of such a request starts a
        fresh context after them (lower acceptance at worst, never other output)."""
        return () if self.policy.dormant(len(batch.seqs)) else self.capture_layers

    def after_loop(self, batch: Batch, commits: list[Commit], captured: torch.Tensor) -> None:
        if captured.numel():
            self.extend_contexts(batch, commits, captured)
        # the first step was skipped (and counted) by the last decision; the loop skipped the rest
        self.counters.num_skipped_drafts += sum(len(c.token_ids) for c in commits) - len(commits)
        self.policy.skipped_in_loop(max(len(c.token_ids) for c in commits), len(batch.seqs))
        self._plan_next(batch, commits)

    def extend_contexts(self, batch: Batch, commits: list[Commit], captured: torch.Tensor) -> None:
        """Feed the drafter the captured rows of the positions the loop committed (subclasses)."""

    def _proposals(self, anchors: list[Anchor], batch: int) -> list[Proposal]:
        """propose(), unless the verify policy finds drafting not worth it for the next step
        (of `batch` requests)."""
        if self.policy.should_draft([self.state(a.seq).verify for a in anchors], batch):
            props = self.propose(anchors)
        else:
            self.counters.num_skipped_drafts += len(anchors)
            props = [Proposal(a.pos, []) for a in anchors]
        self.policy.next_step()
        return props

    def _verify_lengths(self, anchors: list[Anchor], props: list[Proposal], drafting_cost: int) -> list[Proposal]:
        """The verify policy's choice of how many of each proposal's drafts to verify (its
        num_verify), then the end of drafting, whose cost grew with `drafting_cost` (requests, or
        drafted tokens for a drafter that costs per token)."""
        lengths = self.policy.num_to_verify([self.state(a.seq).verify for a in anchors],
                                            [p.confidence for p in props], [len(p.token_ids) for p in props])
        for p, n in zip(props, lengths):
            p.num_verify = n
        self.policy.end_drafting(drafting_cost)
        return props

    def _context_reaches(self, seq: Sequence, anchor_pos: int) -> bool:
        """Whether the drafter's context of `seq` holds every position before `anchor_pos`
        (a drafter without context: always)."""
        return True

    def _wants_drafts(self, seq: Sequence, commit: Commit) -> bool:
        """Skip drafting for a request with one token left (the bonus is free) or whose drafts
        stopped paying."""
        left = seq.params.max_tokens - seq.num_output_tokens - len(commit.token_ids)
        st: SpecState | None = seq.method_state
        return (left >= 2 and self.num_speculative_tokens > 0 and seq.params.num_speculative_tokens != 0
                and not (st and st.drafting_off))

    def on_finished(self, seq: Sequence) -> None:
        if seq.params.num_speculative_tokens == 0 and seq.finish_reason is not None:   # not a preemption
            self.counters.num_requests_drafting_off += 1
        if seq.method_state is not None:
            seq.method_state.release()

    def stats(self) -> dict[str, float]:
        return self.counters.as_dict()

    def draft_counts(self, seq: Sequence) -> tuple[int, int, str | None]:
        st: SpecState | None = seq.method_state
        if seq.params.num_speculative_tokens == 0:
            why = "request"
        elif st is not None and st.drafting_off:
            why = "fallback"
        else:
            why = None
        if st is None:
            return 0, 0, why
        return st.num_drafted_tokens, st.num_emitted_tokens - st.num_verify_steps, why

    def acceptance_length(self, seq: Sequence) -> float | None:
        """τ: tokens committed per verify step (accepted drafts + the bonus)."""
        st: SpecState | None = seq.method_state
        if st is None or not st.num_verify_steps:
            return None
        return st.num_emitted_tokens / st.num_verify_steps

    # --- verification ----------------------------------------------------------------------
    def _verify(self, batch: Batch, out: StepOutput) -> list[Commit]:
        rows = out.split(batch)
        todo = [(i, s) for i, s in enumerate(batch.seqs) if s.num_logits]
        tokens = self._target_tokens(todo, rows, out.logits)
        commits = []
        for i, s in enumerate(batch.seqs):
            if not s.num_logits:      # a prefill chunk short of the end: keep its KV only
                commits.append(Commit([], s.num_known, counted_forward=False))
                continue
            toks = tokens[i]
            if s.num_extra:
                self._record(s.seq, s.num_extra, len(toks) - 1)
            logprobs = None
            if s.seq.params.logprobs is not None:
                logprobs = token_logprobs(rows[i][:len(toks)], toks, [s.seq] * len(toks))
            commits.append(Commit(toks, s.num_known + len(toks) - 1, logprobs))
        return commits

    def _target_tokens(self, todo: list[tuple[int, ScheduledSeq]], rows: list[torch.Tensor],
                       logits: torch.Tensor) -> dict[int, list[int]]:
        """Committed tokens per batch index: accepted drafts + residual/bonus token."""
        result: dict[int, list[int]] = {}
        argmax = logits.argmax(-1).tolist()        # one host sync for every greedy row of the batch
        offsets = [0]
        for r in rows:
            offsets.append(offsets[-1] + r.shape[0])
        for i, s in todo:
            seq = s.seq
            drafts = s.query_ids[s.num_known:]          # what the target actually verified
            if seq.params.greedy and not seq.params.needs_penalties:
                result[i] = greedy_accept(argmax[offsets[i]:offsets[i + 1]], drafts)
                continue
            if seq.params.greedy:        # row j penalized after drafts[:j], as ar would have seen it
                penalized = penalize_drafted_rows(rows[i].clone(), seq, drafts)
                result[i] = greedy_accept(penalized.argmax(-1).tolist(), drafts)
                continue
            st: SpecState | None = seq.method_state
            prop = st.proposal if st is not None else None   # gone if aborted mid-step
            q = prop.probs if s.num_extra and prop is not None else None
            q = q[:s.num_extra] if q is not None else None
            if q is None:            # picked drafts: ar's own draws decide (Sampler.verify_picked)
                toks = self.sampler.verify_picked(rows[i], seq, drafts)
                if toks is not None:
                    result[i] = toks
                    continue
            p = self.sampler.probs(rows[i], [seq] * rows[i].shape[0], drafts)
            ids = torch.tensor(drafts, dtype=torch.long, device=p.device)
            result[i] = verify_drafts(p, ids, q, seq.generator or self.sampler.generator)
        return result

    def _record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        self.counters.record(num_drafted, num_accepted)
        st = self.state(seq)
        if st.proposal is not None and st.proposal.confidence:
            self.policy.observe(st.verify, st.proposal.confidence, num_drafted, num_accepted)
        st.num_verify_steps += 1
        st.num_emitted_tokens += num_accepted + 1
        st.num_drafted_tokens += num_drafted
        if (self.fallback != "none" and st.num_verify_steps >= self.fallback_min_steps
                and st.num_emitted_tokens < self.fallback_tau * st.num_verify_steps):
            st.drafting_off = True
            self.counters.num_fallbacks += 1
