"""`ar`: one token per forward, the baseline every other method must match."""
from __future__ import annotations

from typing import TYPE_CHECKING

from leapfrog.methods.base import Batch, Commit, Method, StepOutput
from leapfrog.sample.sampler import Sampler

if TYPE_CHECKING:
    from leapfrog.methods.base import MethodContext


class AutoregressiveMethod(Method):
    name = "ar"
    decode_loop = True

    def __init__(self, ctx: "MethodContext", **options: object) -> None:
        if options:
            raise ValueError(f"unknown option(s) for method 'ar': {', '.join(sorted(options))}")
        self.sampler: Sampler = ctx.sampler

    def prepare(self, batch: Batch) -> None:
        for s in batch.seqs:
            s.query_ids = s.seq.token_ids[s.start_pos:s.start_pos + s.num_known]
            s.num_logits = 1 if s.reaches_end else 0

    def commit(self, batch: Batch, out: StepOutput) -> list[Commit]:
        sampling = [s.seq for s in batch.seqs if s.num_logits]
        tokens, logprobs = self.sampler.sample(out.logits, sampling) if sampling else ([], [])
        commits, i = [], 0
        for s in batch.seqs:
            if s.num_logits:
                commits.append(Commit([tokens[i]], s.num_known, [logprobs[i]] if logprobs else None))
                i += 1
            else:  # a prefill chunk that does not reach the end: only its KV is kept
                commits.append(Commit([], s.num_known, counted_forward=False))
        return commits
