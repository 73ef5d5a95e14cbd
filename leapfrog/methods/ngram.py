"""`ngram`: speculative decoding without a drafter, by prompt lookup (vLLM's `ngram`): the tokens
that followed the latest earlier occurrence of the request's last n tokens are the drafts. Its
index and confidences: docs/architecture.md, "The methods in detail"."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from leapfrog.methods.base import Batch
from leapfrog.methods.confidence_schedule import StepCostTable
from leapfrog.methods.speculative import Anchor, Proposal, SpeculativeMethod
from leapfrog.methods.verify import make_policy
from leapfrog.sequence import Sequence

if TYPE_CHECKING:
    from leapfrog.methods.base import MethodContext


@dataclass(slots=True)
class NgramIndex:
    """One request's n-grams: (n-gram) -> the position of its last token, for every n-gram that
    ends before position `indexed` (the request's last token is looked up, not indexed). With a
    prediction (OpenAI's Predicted Outputs), also the prediction's n-grams -> every position
    their last token ends at, and where the output was last aligned with it."""
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0
    match_len: object = 0         # the last proposal's match: n, ("prediction", n), or 0 for none
    prediction: list[int] = field(default_factory=list)
    pred_ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    pred_at: int = -1             # the prediction position the output's last token was matched to
    pred_prefix: int = 0          # the output so far is prediction[:pred_prefix] (-1: it left it)


@dataclass(slots=True)
class AcceptanceTable:
    """Acceptance of drafts by match length and position, as verification has shown it:
    accepted / verified with a prior of `prior` over `weight` drafts, decayed so that it
    follows the text being written."""
    gamma: int
    prior: float = 0.5
    # a request's own prediction (the text the client expects back) starts more trusted than a
    # repeat found in its context
    prediction_prior: float = 0.9
    weight: float = 4.0
    decay: float = 0.995
    counts: dict[tuple[int, int], list[float]] = field(default_factory=dict)

    def rate(self, n: int, j: int) -> float:
        acc, seen = self.counts.get((n, j), (0.0, 0.0))
        prior = self.prediction_prior if isinstance(n, tuple) else self.prior
        return (acc + prior * self.weight) / (seen + self.weight)

    def row(self, n: int, k: int) -> list[float]:
        """Conditional acceptance of drafts 1..k after a match of length n."""
        return [self.rate(n, j) for j in range(k)]

    def observe(self, n: int, verified: int, accepted: int) -> None:
        """Drafts 0..verified-1 were checked: the first `accepted` survived, the next failed."""
        for j in range(min(verified, accepted + 1)):
            c = self.counts.setdefault((n, j), [0.0, 0.0])
            c[0] = c[0] * self.decay + (1.0 if j < accepted else 0.0)
            c[1] = c[1] * self.decay + 1.0


class NgramMethod(SpeculativeMethod):
    name = "ngram"

    def __init__(self, ctx: "MethodContext", num_speculative_tokens: int = 5, prompt_lookup_min: int = 2,
                 prompt_lookup_max: int = 5, verify: str = "confidence", threshold: float = 0.5,
                 step_costs: dict | None = None, fallback: str = "none", **options: object) -> None:
        if options:
            raise ValueError(f"unknown option(s) for method {self.name!r}: {', '.join(sorted(options))}")
        lo, hi = prompt_lookup_min, prompt_lookup_max
        if not isinstance(lo, int) or isinstance(lo, bool) or lo < 1:
            raise ValueError(f"prompt_lookup_min={lo!r}: must be an integer >= 1")
        if not isinstance(hi, int) or isinstance(hi, bool) or hi < lo:
            raise ValueError(f"prompt_lookup_max={hi!r}: must be an integer >= prompt_lookup_min ({lo})")
        policy = make_policy(verify, threshold, step_costs,
                             lambda: StepCostTable.profile(ctx.model, ctx.device, max_tokens=256,
                                                                   step=ctx.timed_step))
        super().__init__(ctx, num_speculative_tokens, fallback, policy)
        self.lookup_min, self.lookup_max = lo, hi
        self.table = AcceptanceTable(self.num_speculative_tokens)
        self._misses = 0              # consecutive steps of a batch that verify no drafts

    # --- drafting --------------------------------------------------------------------------
    def propose(self, anchors: list[Anchor]) -> list[Proposal]:
        self.policy.begin_drafting()
        props = []
        for a in anchors:
            tokens = a.seq.token_ids + a.new_token_ids
            idx = self._index(a.seq)
            drafts, n = [], 0
            if idx.prediction:
                drafts, n = self.lookup_prediction(idx, tokens, a.seq.num_prompt_tokens, self.num_speculative_tokens)
            if not drafts:
                drafts, n = self.lookup(idx, tokens, self.num_speculative_tokens)
            idx.match_len = n
            conf = self.table.row(n, len(drafts)) if drafts else None
            props.append(Proposal(a.pos, drafts, None, conf))
        return self._verify_lengths(anchors, props, len(anchors))

    def _proposals(self, anchors: list[Anchor], batch: int) -> list[Proposal]:
        """A lookup costs nothing next to a step: every request looks up at every step, and the
        verify policy decides per step, on the matches' own confidences, how many drafts of each
        to verify (none where verifying would not pay)."""
        props = self.propose(anchors)
        matched = [(a, p) for a, p in zip(anchors, props) if p.token_ids]
        if matched and not self.policy.beats_plain([self.state(a.seq).verify for a, _ in matched],
                                                   [p.confidence for _, p in matched],
                                                   [p.num_verify for _, p in matched], batch):
            for _, p in matched:          # this step goes to the decode loop instead
                p.num_verify = 0
            self.counters.num_skipped_drafts += len(matched)
        verifies = any(p.token_ids and p.num_verify != 0 for p in props)
        self._misses = 0 if verifies else self._misses + 1
        self.policy.drafted_anyway(verifies)
        self.policy.next_step()
        return props

    def lookup(self, idx: NgramIndex, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Index the n-grams ending before the last token, then look the last n tokens up
        (longest n first): up to k tokens that followed their latest earlier occurrence, and n."""
        last = len(tokens) - 1
        for end in range(max(idx.indexed, 0), last):
            for n in range(self.lookup_min, self.lookup_max + 1):
                if end - n + 1 < 0:
                    break
                idx.last_end[tuple(tokens[end - n + 1:end + 1])] = end
        idx.indexed = max(idx.indexed, last)
        for n in range(min(self.lookup_max, last), self.lookup_min - 1, -1):
            end = idx.last_end.get(tuple(tokens[last - n + 1:last + 1]))
            if end is not None:
                return tokens[end + 1:end + 1 + k], n
        return [], 0

    def lookup_prediction(self, idx: NgramIndex, tokens: list[int], num_prompt: int, k: int
                          ) -> tuple[list[int], object]:
        """Drafts from the request's prediction: its continuation while the output so far is its
        start; else what follows the output's last n tokens in it (longest n first), at the first
        occurrence from where the output was last aligned with it (the text moves forward through
        an edited file), else the last one before."""
        pred, out = idx.prediction, tokens[num_prompt:]
        if idx.pred_prefix >= 0:
            m = len(out)
            if m <= len(pred) and out[idx.pred_prefix:] == pred[idx.pred_prefix:m]:
                idx.pred_prefix, idx.pred_at = m, m - 1
                if pred[m:m + k]:
                    return pred[m:m + k], ("prediction", 0)
            else:
                idx.pred_prefix = -1
        for n in range(min(self.lookup_max, len(out)), self.lookup_min - 1, -1):
            ends = idx.pred_ends.get(tuple(tokens[len(tokens) - n:]))
            if ends:
                i = bisect.bisect_left(ends, idx.pred_at)
                end = ends[i] if i < len(ends) else ends[-1]
                if pred[end + 1:end + 1 + k]:
                    idx.pred_at = end
                    return pred[end + 1:end + 1 + k], ("prediction", n)
        return [], 0

    def _index(self, seq: Sequence) -> NgramIndex:
        st = self.state(seq)
        if not isinstance(st.context, NgramIndex):
            st.context = NgramIndex(prediction=list(seq.prediction_ids))
            pred = st.context.prediction
            for end in range(len(pred)):
                for n in range(self.lookup_min, min(self.lookup_max, end + 1) + 1):
                    st.context.pred_ends.setdefault(tuple(pred[end - n + 1:end + 1]), []).append(end)
        return st.context

    # --- what verification showed ----------------------------------------------------------
    def _record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        st = self.state(seq)
        if isinstance(st.context, NgramIndex) and st.context.match_len:
            self.table.observe(st.context.match_len, num_drafted, num_accepted)
        super()._record(seq, num_drafted, num_accepted)

    def loop_steps(self, batch: Batch) -> int:
        """Steps with no drafts run in the C++ decode loop (greedy rows, as the other methods'):
        one at a time while drafts get verified, so the next match is drafted at once; after a
        run of steps verifying nothing (text that does not repeat its input, or drafts that do
        not pay at this load), more per call, up to `ar`'s, whose calls cost less a step."""
        n = super().loop_steps(batch)
        if n > 0:
            return n
        if not all(s.seq.params.greedy and s.seq.params.loop_samples for s in batch.seqs):
            return 0
        return 1 if self._misses < 4 else min(16, self._misses // 2)
