"""Decode steps without Python per token: the C++ decode loop on a CPU (csrc/decode_loop.cpp).
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from leapfrog.engine.block_manager import BlockManager
from leapfrog.layers.attention import StepInterrupted
from leapfrog.layers.cpu_kernels import LoopCall
from leapfrog.methods.base import Batch, Commit, Method, StepOutput
from leapfrog.engine.runner import ModelRunner
from leapfrog.sample.grammar import LoopMasks
from leapfrog.sample.sampler import Sampler
from leapfrog.sequence import Sequence


# LEAPFROG_DECODE_LOOP=0 keeps every step on the layer-by-layer path (comparisons, debugging).
ENABLED = os.environ.get("LEAPFROG_DECODE_LOOP", "1") != "0"


@dataclass(slots=True)
class LoopPlan:
    budgets: list[int]             # tokens each row may produce in this call (>= 1)
    steps: int                     # max(budgets)
    logits_only: bool              # one step, logits back to the method's sampler


class MultiStep:
    def __init__(self, runner: ModelRunner, block_manager: BlockManager, sampler: Sampler,
                 method: Method, max_steps: int, max_model_len: int) -> None:
        self.runner = runner
        self.bm = block_manager
        self.sampler = sampler
        self.method = method
        self.max_steps = max_steps
        self.max_model_len = max_model_len
        self.num_calls = 0
        self.num_loop_steps = 0
        self.num_interrupted_calls = 0     # calls cut short because a request arrived
        self._loop = None                  # the loop plan() found, for run()

    def loop(self):
        model = self.runner.model
        if not ENABLED or self.runner.device.type != "cpu" or not hasattr(model, "decode_loop"):
            return None
        return model.decode_loop(self.runner.block_size)

    def plan(self, batch: Batch, num_waiting: int) -> LoopPlan | None:
        """A plan when the loop can run this batch, else None (the layer-by-layer path runs it)."""
        if not batch.seqs or any(s.num_known != 1 or s.num_extra or not s.reaches_end for s in batch.seqs):
            return None
        allowed = self.method.loop_steps(batch)
        if allowed <= 0:
            return None
        loop = self._loop = self.loop()
        if loop is None or not loop.supports_rows(len(batch.seqs)):
            return None
        if not all(eligible(s.seq) for s in batch.seqs):
            return LoopPlan([1] * len(batch.seqs), 1, True) if self.method.decode_loop else None
        steps = min(allowed, self.max_steps if num_waiting == 0 else 1)
        budgets = []
        for s in batch.seqs:
            seq = s.seq
            n = min(steps, seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq.token_ids))
            n = max(1, n)
            if n > 1 and not self.bm.reserve(seq, seq.num_computed + n):
                n = 1                      # its one slot was reserved by the scheduler
            budgets.append(n)
        return LoopPlan(budgets, max(budgets), False)

    def run(self, batch: Batch, plan: LoopPlan) -> list[Commit]:
        loop = self._loop
        seqs = [s.seq for s in batch.seqs]
        dev = self.runner.device
        t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)
        bs = self.runner.block_size
        width = max(-(-(s.num_computed + n) // bs) for s, n in zip(seqs, plan.budgets))
        tables = t([s.block_table[:width] + [0] * (width - len(s.block_table[:width])) for s in seqs])
        tokens, positions = t([s.token_ids[-1] for s in seqs]), t([s.num_computed for s in seqs])
        anchors = self.runner.model.loop_anchors(seqs)
        call = LoopCall(tokens, positions, tables, t(plan.budgets), anchors=None if anchors is None else t(anchors))
        # A request arriving cuts the call short: before its next step, or (only background rows)
        # at its next barrier inside a step.
        call.interrupt, call.interrupt_mid_step = self.runner.interrupt, all(s.background for s in seqs)
        self.num_calls += 1
        if plan.logits_only:
            call.return_logits = True
            _, _, logits, _ = call.run(loop)
            self.num_loop_steps += 1
            self.method.prepare(batch)
            return self.method.commit(batch, StepOutput(logits))
        stops, bans = [], []
        for s in seqs:
            p = s.params
            stops.append(list(p.stop_token_ids) + ([] if p.ignore_eos else list(s.eos_token_ids)))
            bans.append(list(s.eos_token_ids) + list(p.stop_token_ids) if p.min_tokens else [])
        call.steps, call.sampling = plan.steps, self.sampler.row_settings(seqs, dev)
        call.stop_ids, call.ban_ids = _padded(stops, dev), _padded(bans, dev)
        call.min_left = t([max(0, s.params.min_tokens - s.num_output_tokens) for s in seqs])
        call.capture_layers = list(self.method.loop_capture_layers(batch))
        if any(s.grammar is not None for s in seqs):
            call.masks = LoopMasks(seqs).loop_args()
        out, counts, _, captured = call.run(loop)
        ran = int(counts.max())
        if ran == 0:                       # stopped inside its first step: every row alike, nothing kept
            raise StepInterrupted
        self.num_loop_steps += ran
        if ran < plan.steps and self.runner.interrupt.numpy()[0]:
            self.num_interrupted_calls += 1
        commits = []
        for seq, row, n in zip(seqs, out.tolist(), counts.tolist()):
            seq.num_draws += n
            commits.append(Commit(row[:n], n, forwards=n))
        self.method.after_loop(batch, commits, captured)
        return commits


def _padded(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def eligible(seq: Sequence) -> bool:
    """Whether a sequence's sampling runs inside the loop (else the loop returns logits)."""
    return seq.params.loop_samples
