"""`diffusion`: block-diffusion decoding over the paged KV cache (BD3-LM; SDAR; Fast-dLLM v2;
LLaDA2), single- or multi-block (MBD's Block Buffer), or verified by the AR parent (two-stream
models). Blocks, the progress floor, exact KV, the logit shift and verification:
docs/architecture.md, "The methods in detail"."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from leapfrog.methods.base import Batch, Commit, Method, ScheduledSeq, StepOutput
from leapfrog.sample.rejection import greedy_accept, verify_drafts
from leapfrog.models.diffusion_families import diffusion_spec
from leapfrog.sample.sampler import (Sampler, apply_penalties, bad_words_after, penalize_drafted_rows,
                                     token_logprobs)
from leapfrog.sequence import Sequence

if TYPE_CHECKING:
    from leapfrog.methods.base import MethodContext


@dataclass(slots=True)
class Canvas:
    """A sequence's undecided future (its Sequence.method_state); survives preemption, so
    recompute keeps the text."""
    decided: dict[int, int] = field(default_factory=dict)     # position -> token, past the committed text
    logprobs: dict[int, dict] = field(default_factory=dict)   # position -> entry, when the request asks
    num_active: int = 1                                       # active slots from the first unfinished block
    carry: torch.Tensor | None = None                         # shift: logits row predicting carry_pos
    carry_pos: int = -1
    drafts: list[int] = field(default_factory=list)           # verify: proposals for positions n, n+1, ...
    draft_probs: list[torch.Tensor] = field(default_factory=list)   # their distributions (sampled requests)
    num_drafted: int = 0                                      # verify: this request's drafts checked,
    num_accepted: int = 0                                     # accepted,
    num_verify_steps: int = 0                                 # and steps that verified
    num_verified_tokens: int = 0                              # tokens those steps decided


@dataclass(slots=True)
class _Step:
    """One sequence's denoising step between the forward and its commit."""
    s: ScheduledSeq
    index: int                      # in the batch
    canvas: Canvas
    n: int                          # committed tokens before the step
    limit: int
    need: list[int]                 # undecided positions of the active blocks
    rows: list[int]                 # their rows in the logits table


@dataclass(slots=True)
class DiffusionCounters:
    num_steps: int = 0              # sequence-steps that denoised (one forward of the sequence each)
    num_committed_tokens: int = 0
    num_decided_tokens: int = 0
    num_active_blocks: int = 0      # summed over steps
    num_stored_blocks: int = 0      # blocks holding generated tokens whose exact KV was kept
    num_drafted_tokens: int = 0     # verify: drafts the parent checked
    num_accepted_tokens: int = 0    # verify: drafts it accepted

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {"num_denoise_steps": self.num_steps,
                                 "num_committed_tokens": self.num_committed_tokens,
                                 "num_decided_tokens": self.num_decided_tokens,
                                 "num_stored_blocks": self.num_stored_blocks}
        if self.num_steps:
            out["committed_tokens_per_step"] = self.num_committed_tokens / self.num_steps
            out["decided_tokens_per_step"] = self.num_decided_tokens / self.num_steps
            out["active_blocks_per_step"] = self.num_active_blocks / self.num_steps
        if self.num_drafted_tokens:
            out["num_drafted_tokens"] = self.num_drafted_tokens
            out["num_accepted_tokens"] = self.num_accepted_tokens
            out["draft_acceptance_rate"] = self.num_accepted_tokens / self.num_drafted_tokens
        return out


def _fraction(name: str, value: object, low_open: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not ((0 < value <= 1) if low_open else (0 <= value <= 1)):
        raise ValueError(f"method 'diffusion': {name}={value!r}: must be in {'(0, 1]' if low_open else '[0, 1]'}")
    return float(value)


# The progress floor's choice when no masked position of a block clears the threshold.
FLOORS = ("leftmost", "confident")


class DiffusionMethod(Method):
    name = "diffusion"
    supports_logits_processors = False
    supports_prompt_logprobs = False
    # The canvas follows any number of known tokens: the prompt (prefill and first step share a
    # forward when the budget allows) and committed blocks whose KV is not stored yet.
    max_known_with_extra = 1 << 62

    def __init__(self, ctx: "MethodContext", num_blocks: int = 1, threshold: float | None = None,
                 add_threshold: float = 0.1, semi_threshold: float = 0.9, floor: str = "leftmost",
                 verify: bool = False, later_threshold: float | None = None, **options: object) -> None:
        if options:
            raise ValueError(f"unknown option(s) for method 'diffusion': {', '.join(sorted(options))}")
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"method 'diffusion': num_blocks={num_blocks!r}: must be an integer >= 1")
        self.num_blocks = num_blocks
        self.add_threshold = _fraction("add_threshold", add_threshold, low_open=False)
        self.semi_threshold = _fraction("semi_threshold", semi_threshold, low_open=False)
        if floor not in FLOORS:
            raise ValueError(f"method 'diffusion': floor={floor!r}: must be one of {', '.join(FLOORS)}")
        self.floor = floor
        config = getattr(ctx.model, "config", {})
        spec = diffusion_spec(config, ctx.tokenizer)
        self.family = spec.family
        self.block_size = self.attn_block_size = spec.block_size
        self.mask_token_id = spec.mask_token_id
        two_stream = getattr(ctx.model, "mask_stream", None) is not None
        if two_stream:
            # two-stream model: known rows stay causal (the AR parent), mask rows see their block
            self.attn_bidir_token = spec.mask_token_id
        if not isinstance(verify, bool):
            raise ValueError(f"method 'diffusion': verify={verify!r}: must be true or false")
        if verify and not (two_stream and spec.logit_shift):
            raise ValueError("method 'diffusion': verify=true needs a two-stream model (config.json "
                             "\"diffusion_mask_stream\": true), whose known rows are the causal AR parent; "
                             "this model's rows all see their whole block")
        self.verify = verify
        # verify: the confidence a mask row's prediction needs to be drafted (default 0: draft them
        # all, a wrong draft costs only the row it took); otherwise to be decided (default 0.9)
        if threshold is None:
            threshold = 0.0 if verify else 0.9
        self.threshold = _fraction("threshold", threshold, low_open=not verify)
        # the threshold of the blocks after the first unfinished one (num_blocks > 1)
        self.later_threshold = self.threshold if later_threshold is None else \
            _fraction("later_threshold", later_threshold, low_open=True)
        self.logit_shift = int(spec.logit_shift)
        self.eos_token_ids = tuple(spec.eos_token_ids)    # the engine stops on these too
        self._eos = set(spec.eos_token_ids)
        self.max_positions = int(config.get("max_position_embeddings", 1 << 30))
        self.max_step_tokens = num_blocks * self.block_size      # the engine checks its token budget
        self.sampler: Sampler = ctx.sampler
        self.counters = DiffusionCounters()

    # --- the window ---------------------------------------------------------------------------
    def _canvas(self, seq: Sequence) -> Canvas:
        if seq.method_state is None:
            seq.method_state = Canvas()
        return seq.method_state

    def num_extra_tokens(self, seq: Sequence) -> int:
        n = len(seq.token_ids)
        end = min((n // self.block_size + self.num_blocks) * self.block_size, self.max_positions)
        return max(0, end - n)

    def _ends(self, seq: Sequence, token: int) -> bool:
        p = seq.params
        return token in p.stop_token_ids or (not p.ignore_eos and token in self._eos)

    def _limit(self, seq: Sequence, canvas: Canvas) -> int:
        """First position never to decode: past max_tokens, the context, or a decided end token."""
        limit = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_positions)
        ends = [p + 1 for p, t in canvas.decided.items() if self._ends(seq, t)]
        return min([limit, *ends])

    def _progress(self, canvas: Canvas, num_committed: int, block: int) -> float:
        lo, hi = block * self.block_size, (block + 1) * self.block_size
        done = max(0, min(hi, num_committed) - lo) + sum(lo <= p < hi for p in canvas.decided)
        return done / self.block_size

    # --- Method ---------------------------------------------------------------------------------
    def prepare(self, batch: Batch) -> None:
        for s in batch.seqs:
            seq, end = s.seq, s.start_pos + s.num_query
            s.query_ids = seq.token_ids[s.start_pos:s.start_pos + s.num_known]
            if not s.num_extra:        # a prefill chunk on the block grid; its last row may be carried
                s.num_logits = self.logit_shift
                continue
            canvas, n = self._canvas(seq), len(seq.token_ids)
            drafts = canvas.drafts
            s.query_ids = s.query_ids + [drafts[p - n] if p - n < len(drafts) else
                                         canvas.decided.get(p, self.mask_token_id) for p in range(n, end)]
            # Rows that predict the undecided positions (>= n); with the shift, from row n-1 when fed.
            s.num_logits = end - max(s.start_pos, n - self.logit_shift)

    def commit(self, batch: Batch, out: StepOutput) -> list[Commit]:
        rows, commits, steps, carried = out.split(batch), [], [], []
        offset = 0
        for i, (s, r) in enumerate(zip(batch.seqs, rows)):
            if s.seq.is_finished:      # aborted during the step
                commits.append(Commit([], 0, counted_forward=False))
            elif not s.num_extra:
                commits.append(self._store_chunk(s, r))
            else:
                commits.append(None)
                steps.append(self._plan(i, s, offset, out.logits.shape[0], carried))
            offset += s.num_logits
        table = torch.cat([out.logits, torch.stack(carried)]) if carried else out.logits
        for st, cand in zip(steps, self._candidates(table, steps)):
            commits[st.index] = self._denoise(st, cand, rows[st.index])
        return commits

    def on_finished(self, seq: Sequence) -> None:
        if seq.is_finished:              # keep only the counts the request's usage reports
            c = seq.method_state
            seq.method_state = None if c is None else Canvas(
                num_drafted=c.num_drafted, num_accepted=c.num_accepted,
                num_verify_steps=c.num_verify_steps, num_verified_tokens=c.num_verified_tokens)
        elif seq.method_state is not None:   # preempted: decided tokens stay, the carry is recomputed
            seq.method_state.carry = None

    def stats(self) -> dict[str, float]:
        return self.counters.as_dict()

    def draft_counts(self, seq: Sequence) -> tuple[int, int, str | None] | None:
        """Verified decoding only: the request's drafts checked and accepted, as a speculative
        method's; why drafting is off: "request" (num_speculative_tokens 0)."""
        if not self.verify:
            return None
        canvas: Canvas | None = seq.method_state
        why = "request" if seq.params.num_speculative_tokens == 0 else None
        return (0, 0, why) if canvas is None else (canvas.num_drafted, canvas.num_accepted, why)

    def acceptance_length(self, seq: Sequence) -> float | None:
        canvas: Canvas | None = seq.method_state
        if not self.verify or canvas is None or not canvas.num_verify_steps:
            return None
        return canvas.num_verified_tokens / canvas.num_verify_steps

    # --- one step -------------------------------------------------------------------------------
    def _store_chunk(self, s: ScheduledSeq, rows: torch.Tensor) -> Commit:
        """Known tokens only (a prefill chunk): keep the KV of its whole blocks."""
        end = s.start_pos + s.num_known
        keep = end - end % self.block_size - s.start_pos   # the scheduler chunks on the grid already
        if self.logit_shift and keep == s.num_known:
            canvas = self._canvas(s.seq)
            canvas.carry, canvas.carry_pos = rows[-1].clone(), end
        return Commit([], keep, counted_forward=end > s.seq.num_prompt_tokens)

    def _plan(self, index: int, s: ScheduledSeq, offset: int, num_rows: int,
              carried: list[torch.Tensor]) -> _Step:
        """The positions this step predicts and their rows in the logits table (logits, then
        carried rows): row p - shift, or the carried row when row n-1 is already cached."""
        seq, bs = s.seq, self.block_size
        canvas, n = self._canvas(seq), len(seq.token_ids)
        limit = self._limit(seq, canvas)
        top = min(limit, (n // bs + canvas.num_active) * bs)
        need = [p for p in range(n, top) if p not in canvas.decided]
        first = s.start_pos + s.num_query - s.num_logits      # position of this sequence's first row
        rows = [offset + p - self.logit_shift - first for p in need]
        if first > n - self.logit_shift:
            if canvas.carry is None or canvas.carry_pos != n:
                raise RuntimeError(f"diffusion: no carried logits for position {n} of {seq.request_id}")
            rows[0] = num_rows + len(carried)
            carried.append(canvas.carry)
        return _Step(s, index, canvas, n, limit, need, rows)

    def _candidates(self, table: torch.Tensor, steps: list[_Step]) -> list[tuple]:
        """(tokens, confidences, logits) per step. Greedy requests share one softmax; the
        mask token is never a candidate."""
        out: list[tuple | None] = [None] * len(steps)
        fast = [k for k, st in enumerate(steps) if st.s.seq.params.greedy and not st.s.seq.params.needs_penalties]
        if fast:
            x = self._gather(table, [r for k in fast for r in steps[k].rows])
            conf, tokens = x.softmax(-1).max(-1)
            conf, tokens, at = conf.tolist(), tokens.tolist(), 0
            for k in fast:
                m = len(steps[k].rows)
                out[k], at = (tokens[at:at + m], conf[at:at + m], x[at:at + m]), at + m
        for k, st in enumerate(steps):
            if out[k] is None:
                x = self._gather(table, st.rows)
                # verify: row i is the parent's after the drafts fed before it, penalized as `ar`'s
                out[k] = (*self._sample(st.s.seq, x, st.canvas.drafts if self.verify else None), x)
        return out

    def _gather(self, table: torch.Tensor, rows: list[int]) -> torch.Tensor:
        x = table.index_select(0, torch.tensor(rows, device=table.device))
        x[:, self.mask_token_id] = float("-inf")
        return x

    def _sample(self, seq: Sequence, logits: torch.Tensor,
                drafts: list[int] | None = None) -> tuple[list[int], list[float]]:
        """Greedy with penalties, or a draw from the request's filtered distribution with its
        own generator; the confidence is the chosen token's probability. `drafts`: row j comes
        after drafts[:j] (a verify step), else every row after the committed output."""
        seqs = [seq] * logits.shape[0]
        if seq.params.greedy:
            x = penalize_drafted_rows(logits.clone(), seq, drafts) if drafts is not None and \
                seq.params.needs_penalties else apply_penalties(logits.clone(), seqs)
            conf, tokens = x.softmax(-1).max(-1)
        else:
            probs = self.sampler.probs(logits, seqs, drafts=drafts)
            tokens = self.sampler.draw(probs, seqs)
            conf = probs.gather(-1, tokens[:, None]).squeeze(-1)
        return tokens.tolist(), conf.tolist()

    def _denoise(self, st: _Step, cand: tuple, rows: torch.Tensor) -> Commit:
        seq, bs, start, n, canvas = st.s.seq, self.block_size, st.s.start_pos, st.n, st.canvas
        front = n // bs
        tokens, conf, logits = cand
        progress = [self._progress(canvas, n, front + j) for j in range(canvas.num_active)]
        exact = 0
        if self.verify:
            picked, exact = self._verified(seq, canvas, n, st, cand)
        else:
            table = {p: (t, c) for p, t, c in zip(st.need, tokens, conf)}
            picked = self._decide(seq, canvas, front, n, table, st.limit, progress)
        if seq.params.logprobs is not None and picked:
            at = {p: i for i, p in enumerate(st.need)}
            chosen = logits[torch.tensor([at[p] for p in picked], device=logits.device)]
            picked_ids = [canvas.decided[p] for p in picked]
            for p, entry in zip(picked, token_logprobs(chosen, picked_ids, [seq] * len(picked))):
                canvas.logprobs[p] = entry
        if self.logit_shift and start < n:    # row n-1 (rows[0]) is fed: carry it for position n
            canvas.carry, canvas.carry_pos = rows[0].clone(), n
        committed, limit = self._commit_prefix(seq, canvas, n)
        self._activate(canvas, front, n + len(committed), limit)
        c = self.counters
        c.num_steps += 1
        c.num_committed_tokens += len(committed)
        c.num_decided_tokens += len(picked)
        c.num_active_blocks += len(progress)
        keep = front * bs
        if self.verify:
            # Known rows are the causal parent's: the KV of every position fed with its final
            # token is exact, so keep it (as a speculative verify does) and leave the last
            # committed token to be fed again, its row predicting the next position (no carry).
            keep = max(keep, min(n + exact, n + len(committed) - 1))
        else:
            c.num_stored_blocks += max(0, front - max(start, seq.num_prompt_tokens) // bs)
        logprobs = [canvas.logprobs.pop(p, {}) for p in range(n, n + len(committed))]
        return Commit(committed, keep - start, logprobs if seq.params.logprobs is not None else None)

    def _decide(self, seq: Sequence, canvas: Canvas, front: int, n: int, cand: dict,
                limit: int, progress: list[float]) -> list[int]:
        """Threshold acceptance with the progress floor, block by block from the front."""
        bs, picked = self.block_size, []
        for j in range(canvas.num_active):
            block = front + j
            masked = [p for p in range(max(block * bs, n), min((block + 1) * bs, limit)) if p in cand]
            if not masked:
                continue
            bar = self.threshold if j == 0 else self.later_threshold
            pick = [p for p in masked if cand[p][1] > bar]
            if not pick and (j == 0 or progress[j - 1] >= self.semi_threshold):
                pick = [masked[0] if self.floor == "leftmost"
                        else max(masked, key=lambda p: cand[p][1])]    # ties: the leftmost
            for p in pick:
                canvas.decided[p] = cand[p][0]
                if self._ends(seq, cand[p][0]):
                    limit = min(limit, p + 1)                     # nothing after the end is decoded
            picked += pick
        return picked

    def _verified(self, seq: Sequence, canvas: Canvas, n: int, st: _Step, cand: tuple) -> tuple[list[int], int]:
        """Verify the drafts against the parent's rows, then draft again from the mask rows.
        Decides positions n, n+1, ... (accepted drafts + one token); returns them and how many
        of them, from n, were fed this step holding their final token (their KV is exact)."""
        tokens, conf, logits = cand
        need, limit = st.need, st.limit              # need = n .. top-1: nothing is decided ahead
        drafts, q = canvas.drafts, canvas.draft_probs
        fed = drafts[:len(need)]
        m = min(len(drafts), len(need) - 1)          # drafts with a parent row after them this step
        p_greedy = seq.params.greedy
        if p_greedy:
            out = greedy_accept(tokens[:m + 1], drafts[:m])
        else:
            p = self.sampler.probs(logits[:m + 1], [seq] * (m + 1), drafts=drafts[:m])
            qm = torch.stack(q[:m]) if m else None     # each draft's distribution, kept with it
            ids = torch.tensor(drafts[:m], dtype=torch.long, device=p.device)
            out = verify_drafts(p, ids, qm, seq.generator or self.sampler.generator)
        self.counters.num_drafted_tokens += m
        self.counters.num_accepted_tokens += len(out) - 1
        canvas.num_drafted += m
        canvas.num_accepted += len(out) - 1
        held = len(out) == m + 1 and m == len(drafts)   # every draft accepted: the mask rows saw the truth
        canvas.drafts, canvas.draft_probs = [], []
        picked = []
        for i, t in enumerate(out):
            if n + i >= limit:
                held = False
                break
            canvas.decided[n + i] = t
            picked.append(n + i)
            if self._ends(seq, t):
                held = False
                break
        canvas.num_verify_steps += 1
        canvas.num_verified_tokens += len(picked)
        cap = seq.params.num_speculative_tokens        # the request's own bound (0: no drafts)
        if held:
            # the mask rows after the last decided position: the next step's drafts, while confident
            for i in range(len(out), len(need)):
                if need[i] >= limit or conf[i] <= self.threshold or (cap is not None and len(canvas.drafts) >= cap):
                    break
                canvas.drafts.append(tokens[i])
                if not p_greedy:
                    canvas.draft_probs.append(self.sampler.probs(logits[i:i + 1], [seq])[0])
        exact = 0
        while exact < min(len(picked), len(fed)) and fed[exact] == out[exact]:
            exact += 1
        return picked, exact

    def _commit_prefix(self, seq: Sequence, canvas: Canvas, n: int) -> tuple[list[int], int]:
        """Pop the decided run that starts at the committed text; stop after an end token. A
        token that would complete one of the request's bad words is taken back, with what was
        decided after it: a position decided beside others in a step was banned only after the
        committed text, and is decided again once the text before it is committed."""
        limit = self._limit(seq, canvas)
        out, p = [], n
        while p < limit and p in canvas.decided:
            if (seq.bad_words_ids and not self.verify     # (a verify step's rows are penalized after their drafts)
                    and canvas.decided[p] in bad_words_after(seq.output_ids + out, seq.bad_words_ids)):
                for q in [q for q in canvas.decided if q >= p]:
                    del canvas.decided[q]
                    canvas.logprobs.pop(q, None)
                break
            out.append(canvas.decided.pop(p))
            p += 1
        return out, limit

    def _activate(self, canvas: Canvas, front: int, n: int, limit: int) -> None:
        """Slide the window past committed blocks; admit the next block while the last active
        one's progress exceeds add_threshold (MBD τ_add)."""
        bs, new_front = self.block_size, n // self.block_size
        active = max(1, front + canvas.num_active - new_front)
        while (active < self.num_blocks and (new_front + active) * bs < limit
               and self._progress(canvas, n, new_front + active - 1) > self.add_threshold):
            active += 1
        canvas.num_active = active
