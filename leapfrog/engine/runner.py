"""Batch -> tensors -> model forward -> logits (and the hidden rows of the layers the method taps).

Queries of all sequences are flattened into one [T] token row (varlen, as vLLM does).
Attention is computed per group: sequences that feed at most `small_query` tokens (decode,
verification) are padded together into one [B, Lq] x [B, Lk] problem; each longer query
(a prefill chunk) is its own group, so one long prompt never pads the whole batch.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from leapfrog.layers.attention import AttnGroup, AttnMetadata
from leapfrog.layers.cpu_kernels import cpu_kernels
from leapfrog.layers.parallel import pp_size, recv_wait_seconds
from leapfrog.methods.base import Batch, ScheduledSeq, StepOutput


class ModelRunner:
    small_query = 32

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int,
                 device: torch.device, kv_dtype: torch.dtype) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.num_blocks = num_blocks
        self._allocate_cache(num_blocks * block_size, kv_dtype)
        self.cpu_decode_kernel = False
        self.pipeline_stats = PipelineStats()
        # Set (by any thread) when live work arrives: a step of only background rows stops at its
        # next barrier (StepInterrupted, or a decode loop call keeping its finished steps). Only
        # the engine's own runner, in a single process, is interruptible (ranks would have to stop
        # together; a drafter's runner is driven by its method).
        self.interrupt = torch.zeros(1, dtype=torch.int32)
        self.interruptible = False
        # One attention group a step (EngineConfig.batch_invariant): every row then runs the fused
        # forward, as a prompt prefilled alone does, instead of torch's layer path.
        self.one_group = False
        if device.type == "cpu":
            self.cpu_decode_kernel = cpu_kernels() is not None

    def _allocate_cache(self, num_slots: int, dtype: torch.dtype) -> None:
        for attn in self.model.attention_layers:
            shape = (num_slots, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)

    @staticmethod
    def kv_bytes_per_token(model: nn.Module, dtype: torch.dtype) -> int:
        size = torch.tensor([], dtype=dtype).element_size()
        return sum(2 * a.num_kv_heads * a.head_dim * size for a in model.attention_layers)

    # --- input preparation -----------------------------------------------------------------
    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata, torch.Tensor]:
        ids, pos, slots, logit_rows = [], [], [], []
        row = 0
        for s in batch.seqs:
            n = s.num_query
            ids.extend(s.query_ids)
            pos.extend(self.model.rotary_positions(s.seq, s.start_pos, n))
            slots.extend(self._slots(s.seq.block_table, s.start_pos, s.start_pos + n))
            logit_rows.extend(range(row, row + s.num_prompt_logits))     # the engine's (prompt logprobs)
            logit_rows.extend(range(row + n - s.num_logits, row + n))
            row += n
        dev = self.device
        t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)
        meta = AttnMetadata(t(slots), self._groups(batch), batch.attn_bidir_token)
        return t(ids), t(pos), meta, t(logit_rows)

    def _groups(self, batch: Batch) -> list[AttnGroup]:
        if self.one_group and self.cpu_decode_kernel:
            members, row = [], 0
            for s in batch.seqs:
                members.append((row, s))
                row += s.num_query
            return [self._group(members, batch.attn_block_size, batch.attn_bidir_token)]
        small, groups, row = [], [], 0
        for s in batch.seqs:
            if s.num_query <= self.small_query:
                small.append((row, s))
            else:
                groups.append(self._group([(row, s)], batch.attn_block_size, batch.attn_bidir_token))
            row += s.num_query
        if small:
            groups.insert(0, self._group(small, batch.attn_block_size, batch.attn_bidir_token))
        return groups

    def _group(self, members: list[tuple[int, ScheduledSeq]], attn_block: int,
               bidir: int | None = None) -> AttnGroup:
        dev = self.device
        lq = max(s.num_query for _, s in members)
        lk = max(s.start_pos + s.num_query for _, s in members)
        max_blocks = -(-lk // self.block_size)
        tables = torch.tensor([s.seq.block_table[:max_blocks] + [0] * (max_blocks - len(s.seq.block_table[:max_blocks]))
                               for _, s in members], dtype=torch.long, device=dev)
        rows0 = members[0][0]
        contiguous = all(r == rows0 + i * lq and s.num_query == lq for i, (r, s) in enumerate(members))
        if self.cpu_decode_kernel:
            return self._kernel_group(members, attn_block, tables, bidir)
        kpos = torch.arange(lk, device=dev)
        kv_slots = tables[:, kpos // self.block_size] * self.block_size + kpos % self.block_size
        qlen = torch.tensor([s.num_query for _, s in members], device=dev)
        start = torch.tensor([s.start_pos for _, s in members], device=dev)
        qoff = torch.arange(lq, device=dev)
        q_valid = qoff.unsqueeze(0) < qlen.unsqueeze(1)                    # [B, Lq]
        qpos = start.unsqueeze(1) + qoff.unsqueeze(0)                       # [B, Lq]
        ctx = (start + qlen).view(-1, 1, 1)
        qend = (qpos // attn_block + 1) * attn_block                        # [B, Lq] first key not seen
        if bidir is not None and attn_block > 1:    # only rows holding `bidir` see their whole block
            qids = torch.tensor([s.query_ids + [-1] * (lq - s.num_query) for _, s in members], device=dev)
            qend = torch.where(qids == bidir, qend, qpos + 1)
        allowed = (kpos.view(1, 1, -1) < ctx) & (kpos.view(1, 1, -1) < qend.unsqueeze(-1))
        allowed |= ~q_valid.unsqueeze(-1) & (kpos == 0).view(1, 1, -1)       # padding rows: no NaNs
        # One query row per sequence, all with the full context: nothing to mask.
        mask = None if (lq == 1 and bool((ctx == lk).all())) else allowed.unsqueeze(1)
        if contiguous:
            return AttnGroup(None, kv_slots, mask, None, None, row_start=rows0)
        q_index = torch.tensor([[r + min(j, s.num_query - 1) for j in range(lq)] for r, s in members],
                               dtype=torch.long, device=dev)
        out_rows = q_index[q_valid]
        return AttnGroup(q_index, kv_slots, mask, out_rows, q_valid)

    def _kernel_group(self, members: list[tuple[int, ScheduledSeq]], attn_block: int,
                      tables: torch.Tensor, bidir: int | None = None) -> AttnGroup:
        """Few-token queries for the CPU paged kernel: every query row becomes a "sequence" of
        its own whose context is a prefix of its sequence's keys. Causal: keys up to its own
        position; block-causal: up to the end of its block (or of the known keys), or with
        `bidir` only for rows holding that token (the others causal). Verification
        and diffusion steps then read the paged cache directly, as decode steps do."""
        rows, lens, owner = [], [], []
        for i, (r, s) in enumerate(members):
            end = s.start_pos + s.num_query
            for j in range(s.num_query):
                p = s.start_pos + j
                rows.append(r + j)
                causal = bidir is not None and s.query_ids[j] != bidir
                lens.append(min(end, p + 1 if causal else (p // attn_block + 1) * attn_block))
                owner.append(i)
        dev = self.device
        t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)
        if len(rows) != len(members):
            tables = tables.index_select(0, t(owner))
        contiguous = rows[-1] - rows[0] == len(rows) - 1
        return AttnGroup(None, None, None, None if contiguous else t(rows), None, row_start=rows[0],
                         block_tables=tables, ctx_lens=t(lens), block_size=self.block_size)

    # --- the forward ----------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: Batch) -> StepOutput:
        if pp_size() > 1 and len(batch.seqs) > 1 and hasattr(self.model, "stage_forward"):
            return self._run_pipelined(batch)
        ids, pos, meta, logit_rows = self.prepare(batch)
        if self.interruptible and all(s.seq.background for s in batch.seqs):
            meta.interrupt = self.interrupt
        hidden, captured = self.model(ids, pos, meta, batch.capture_layers)
        logits = self.model.compute_logits(hidden[logit_rows])
        return StepOutput(logits, captured)

    def _run_pipelined(self, batch: Batch) -> StepOutput:
        """A step over pipeline stages in micro-batches (GPipe's schedule, forward only): the
        batch's sequences are cut into up to pp_size() runs of about equal query tokens, and each
        stage sends a micro-batch on without waiting, so stage s works on micro-batch m while
        stage s+1 works on m-1. Then the last stage's logits (and the captured rows) reach every
        rank. The time this rank spent on its own layers is counted apart from the step's wall
        time (the rest is the bubble: waiting for rows from the previous stage, for the sends
        to drain and for the last stage's logits)."""
        t0, waited = time.perf_counter(), recv_wait_seconds()
        parts = micro_batches(batch, pp_size())
        hidden, captured, shapes, rows, sends = [], [], [], [], []
        for part in parts:
            ids, pos, meta, logit_rows = self.prepare(part)
            h, cap, send = self.model.stage_forward(ids, pos, meta, batch.capture_layers)
            hidden.append(h[logit_rows] if h is not None else None)
            captured.append(cap)
            shapes.append(ids.shape)
            rows.append(logit_rows.numel())
            if send is not None:
                sends.append(send)
        busy = time.perf_counter() - t0 - (recv_wait_seconds() - waited)
        for s in sends:
            s.wait()
        _, cap = self.model.finish_stage(None, captured, shapes, batch.capture_layers)
        h = torch.cat(hidden) if hidden[0] is not None else \
            torch.zeros(sum(rows), self.model.config["hidden_size"], device=self.device)
        logits = self.model.compute_logits(h)
        self.pipeline_stats.add(time.perf_counter() - t0, busy)
        return StepOutput(logits, cap)


class PipelineStats:
    """Pipelined steps on this rank: their wall time, and the part spent in its own stage's work
    (the rest is the pipeline's bubble as this rank sees it: waiting for a neighbour's rows, and
    for the last stage's logits)."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.seconds = 0.0
        self.busy_seconds = 0.0

    def add(self, seconds: float, busy: float) -> None:
        self.num_steps += 1
        self.seconds += seconds
        self.busy_seconds += busy

    def as_dict(self) -> dict:
        return {"num_steps": self.num_steps, "seconds": self.seconds, "busy_seconds": self.busy_seconds}


def micro_batches(batch: Batch, n: int) -> list[Batch]:
    """The batch's sequences in up to `n` contiguous runs of about equal query tokens."""
    seqs = batch.seqs
    n = max(1, min(n, len(seqs)))
    total = sum(s.num_query for s in seqs)
    parts, cur, acc = [], [], 0
    for i, s in enumerate(seqs):
        cur.append(s)
        acc += s.num_query
        left = len(seqs) - i - 1                       # sequences not placed yet
        need = n - len(parts) - 1                      # runs still to open after this one
        if need and (acc * n >= total * (len(parts) + 1) or left == need):
            parts.append(cur)
            cur = []
    if cur:
        parts.append(cur)
    return [Batch(p, batch.attn_block_size, batch.capture_layers, batch.attn_bidir_token) for p in parts]
