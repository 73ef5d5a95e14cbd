"""Rotary position embeddings with the scaling variants Hugging Face configs name.

The rotate-half layout (first half / second half of each head) matches the Llama, Qwen2 and
Qwen3 checkpoints, whose q/k projection rows are stored in that order.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(config: dict) -> dict:
    """One dict with rope_type and rope_theta, from old (rope_theta + rope_scaling) or
    new (rope_parameters, transformers >= 5) config layouts."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def _default(p: dict, dim: int) -> tuple[torch.Tensor, float]:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (p["rope_theta"] ** exponents), 1.0


def _linear(p: dict, dim: int) -> tuple[torch.Tensor, float]:
    inv, scale = _default(p, dim)
    return inv / p["factor"], scale


def _llama3(p: dict, dim: int) -> tuple[torch.Tensor, float]:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    inv, _ = _default(p, dim)
    factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > old_len / lo, inv / factor, inv)
    mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
    return torch.where(mid, blended, out), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(p: dict, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    # YaRN (Peng et al. 2023, §3.2-3.4): NTK-by-parts interpolation plus attention temperature.
    base, factor = p["rope_theta"], p["factor"]
    old_len = p.get("original_max_position_embeddings") or max_pos
    attn = p.get("attention_factor")
    if attn is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attn = _yarn_mscale(factor, p["mscale"]) / _yarn_mscale(factor, p["mscale_all_dim"])
        else:
            attn = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast", 32)), correction_dim(p.get("beta_slow", 1))
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp
    inv = (1 / (factor * pos_freqs)) * (1 - extrapolate) + (1 / pos_freqs) * extrapolate
    return inv, attn


def inv_frequencies(config: dict, head_dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """The rotary frequencies and attention factor of a config's rope type. `freq_factors` (a GGUF
    file's rope_freqs tensor, checkpoint/gguf.py) divides the frequencies, as llama.cpp does."""
    inv, attn = _inv_frequencies(config, head_dim, max_pos)
    factors = rope_parameters(config).get("freq_factors")
    if factors is not None:
        if len(factors) != inv.numel():
            raise ValueError(f"config.json: rope freq_factors has {len(factors)} values, the rotary "
                             f"dimension needs {inv.numel()}")
        inv = (inv.double() / torch.tensor(factors, dtype=torch.float64)).float()
    return inv, attn


def _inv_frequencies(config: dict, head_dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    p = rope_parameters(config)
    dim = int(head_dim * p.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    kind = p["rope_type"]
    if kind in ("default", "dynamic"):  # dynamic NTK equals default up to the trained length
        return _default(p, dim)
    if kind == "linear":
        return _linear(p, dim)
    if kind == "llama3":
        return _llama3(p, dim)
    if kind == "yarn":
        return _yarn(p, dim, max_pos)
    raise ValueError(f"config.json: unsupported rope_type {kind!r} "
                     "(supported: default, linear, dynamic, llama3, yarn)")


def coupled_positions(input_ids: torch.Tensor, bos_id: int, anchor_id: int) -> torch.Tensor:
    """Rotary positions [B, T] that restart after the first ``anchor_id`` of each example (an
    example starts at ``bos_id``): a couplet's 下联 character j gets the position of its 上联's
    character j, and </s> that of the <sep> (position coupling, Cho et al. 2024). Before the
    anchor, positions count from the example's start."""
    b, t = input_ids.shape
    idx = torch.arange(t, device=input_ids.device).expand(b, t)
    start = torch.where(input_ids == bos_id, idx, 0).cummax(dim=1).values
    anchor = input_ids == anchor_id
    count = anchor.long().cumsum(dim=1)
    first = anchor & (count - count.gather(1, start) == 1)       # the first anchor of its example
    last_first = torch.where(first, idx, -1).cummax(dim=1).values
    base = torch.where((last_first >= start) & (last_first < idx), last_first, start)
    return idx - base


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table indexed by absolute position."""

    def __init__(self, config: dict, head_dim: int, max_pos: int) -> None:
        super().__init__()
        inv, attn_factor = inv_frequencies(config, head_dim, max_pos)
        self.rotary_dim = inv.numel() * 2
        t = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * attn_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attn_factor, persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [..., T] -> [..., T, 1, D]; looked up once per forward."""
        return (self.cos[positions].unsqueeze(-2).to(dtype), self.sin[positions].unsqueeze(-2).to(dtype))

    def apply(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """x: [..., T, heads, D] (query and key heads may be stacked)."""
        cos, sin = rope
        return _apply(x, cos, sin, self.rotary_dim)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    if rot < x.shape[-1]:
        return torch.cat([_apply(x[..., :rot], cos, sin, rot), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
