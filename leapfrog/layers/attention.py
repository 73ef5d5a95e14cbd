"""Paged attention over a flat KV cache, through torch's scaled_dot_product_attention.

The cache of one layer is a pair of tensors [num_slots, num_kv_heads, head_dim]; a slot is
block_id * block_size + offset, so a sequence's keys are gathered through its block table.
The runner precomputes, once per step, which slots each query token writes and, per group of
sequences, the gather indices and mask; every layer reuses them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class AttnGroup:
    """Sequences attended together as one padded [B, Lq] x [B, Lk] problem."""
    q_index: torch.Tensor | None    # [B, Lq] rows of the flat query; None: rows row_start.. in order
    kv_slots: torch.Tensor          # [B, Lk] cache slots to gather (padding points at slot 0)
    mask: torch.Tensor | None       # [B, 1, Lq, Lk] True = may attend; None = attend to all
    out_rows: torch.Tensor | None   # [N] flat rows receiving the valid outputs (None when q_index is None)
    q_valid: torch.Tensor | None    # [B, Lq] which padded query cells are real
    row_start: int = 0
    # Few-token groups on CPU read the paged cache directly, one kernel row per query row
    # (out_rows: their flat rows when not row_start.. in order):
    block_tables: torch.Tensor | None = None   # [R, max_blocks]
    ctx_lens: torch.Tensor | None = None       # [R] keys 0..ctx_len-1 visible to each row
    block_size: int = 0


@dataclass(slots=True)
class AttnMetadata:
    slot_mapping: torch.Tensor      # [T] where each query token's k/v is written
    groups: list[AttnGroup]
    # A two-stream diffusion model's mask token (Batch.attn_bidir_token): rows holding it run
    # the model's mask stream; None: every row runs the model's own layers.
    mask_token: int | None = None
    # A background step's interrupt flag (int32, one element), or None: another thread sets it
    # when live work arrives, and a model that checks it abandons the forward at a layer
    # boundary by raising StepInterrupted.
    interrupt: torch.Tensor | None = None

    def interrupted(self) -> bool:
        return self.interrupt is not None and bool(self.interrupt.numpy()[0])


class StepInterrupted(Exception):
    """A forward abandoned through AttnMetadata.interrupt: nothing of the step is kept (keys and
    values written past a sequence's computed tokens are rewritten by its next step)."""


class Attention(nn.Module):
    """`window` > 0: a sliding window's layer (Gemma 3's local layers), where a query at
    position i sees keys i - window + 1 .. i only."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.window = window
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self._window_mask: tuple | None = None     # (the group's mask, that mask within the window)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttnMetadata | None) -> torch.Tensor:
        """q: [T, H, D] (or [B, T, H, D] when meta is None: dense causal, no cache)."""
        if meta is None:
            return self._dense_causal(q, k, v)
        self.k_cache.index_copy_(0, meta.slot_mapping, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(0, meta.slot_mapping, v.to(self.v_cache.dtype))
        if len(meta.groups) == 1 and meta.groups[0].out_rows is None:
            return self._group(q, meta.groups[0])
        out = torch.empty_like(q)
        for g in meta.groups:
            if g.out_rows is None:
                o = self._group(q, g)
                out[g.row_start:g.row_start + o.shape[0]] = o
            else:
                out[g.out_rows] = self._group(q, g)
        return out

    def _group(self, q: torch.Tensor, g: AttnGroup) -> torch.Tensor:
        if g.ctx_lens is not None:
            return self._paged_decode(q, g)
        b = g.kv_slots.shape[0]
        if g.q_index is None:
            lq = 1 if g.mask is None else g.mask.shape[2]
            qg = q[g.row_start:g.row_start + b * lq].view(b, lq, self.num_heads, self.head_dim)
        else:
            qg = q[g.q_index]
        # index_select on a flat index is several times faster than advanced indexing on CPU.
        flat = g.kv_slots.view(-1)
        kg = self.k_cache.index_select(0, flat).view(b, -1, self.num_kv_heads, self.head_dim).to(q.dtype)
        vg = self.v_cache.index_select(0, flat).view(b, -1, self.num_kv_heads, self.head_dim).to(q.dtype)
        mask = g.mask if self.window <= 0 else self._windowed(g.mask, b, qg.shape[1], kg.shape[1])
        o = F.scaled_dot_product_attention(
            qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2),
            attn_mask=mask, scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads)
        o = o.transpose(1, 2)
        if g.q_index is None:
            return o.reshape(-1, self.num_heads, self.head_dim)
        return o[g.q_valid]

    def _windowed(self, mask: torch.Tensor | None, b: int, lq: int, lk: int) -> torch.Tensor | None:
        """A group's mask narrowed to the window. A causal row's last visible key is its own
        position, so it keeps the `window` keys ending there; the layers of a step share the
        result (one mask object per step)."""
        cached = self._window_mask
        if cached is not None and cached[0] is mask and cached[1] == (b, lq, lk):
            return cached[2]
        idx = torch.arange(lk, device=self.k_cache.device)
        if mask is None:
            if lk <= self.window:
                return None
            out = (idx >= lk - self.window).expand(b, 1, lq, lk)
        else:
            last = torch.where(mask, idx, -1).amax(dim=-1, keepdim=True)
            out = mask & (idx > last - self.window)
        self._window_mask = (mask, (b, lq, lk), out)
        return out

    def _paged_decode(self, q: torch.Tensor, g: AttnGroup) -> torch.Tensor:
        # deferred: cpu_kernels loads only when a paged decode runs
        from leapfrog.layers.cpu_kernels import cpu_kernels
        b = g.ctx_lens.shape[0]
        qg = q[g.row_start:g.row_start + b] if g.out_rows is None else q.index_select(0, g.out_rows)
        o = cpu_kernels().paged_decode_attention(
            qg, self.k_cache, self.v_cache, g.block_tables, g.ctx_lens, g.block_size, self.scale, self.window)
        return o.to(q.dtype)

    def _dense_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[1]
        mask = None
        if 0 < self.window < t:
            i = torch.arange(t, device=q.device)
            d = i.unsqueeze(1) - i.unsqueeze(0)
            mask = (d >= 0) & (d < self.window)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=mask is None,
            attn_mask=mask, scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads)
        return o.transpose(1, 2)
