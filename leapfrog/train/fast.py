"""A lean training forward for the built-in Llama models, over the Hugging Face model's own
parameters.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def supported(model) -> bool:
    """The lean forward covers dense Llama models with RoPE of the default kind."""
    c = model.config
    rope = (getattr(c, "rope_parameters", None) or {}).get("rope_type", "default")
    return (c.model_type == "llama" and rope == "default" and not getattr(c, "attention_bias", False)
            and not getattr(c, "mlp_bias", False) and getattr(c, "hidden_act", "silu") == "silu")


def rope_table(model, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of shape [seq_len, head_dim], the halves repeated as in HF's rotate_half form."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def hidden_states(model, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  dropout: float = 0.0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The final-normed hidden states [B, T, H] of a Llama ``model`` for ``input_ids`` [B, T]
    (rotary positions 0..T-1, or ``positions`` [B, T])."""
    c = model.config
    inner = model.model
    b, t = input_ids.shape
    n_heads, n_kv = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_heads
    eps = c.rms_norm_eps
    train = model.training and dropout > 0
    if positions is None:
        cos, sin = cos[:t], sin[:t]
    else:
        cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    x = inner.embed_tokens(input_ids)
    if train:
        x = F.dropout(x, dropout, True)
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        h = F.rms_norm(x, (x.shape[-1],), layer.input_layernorm.weight, eps)
        qkv = F.linear(h, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        q, k, v = qkv.split([n_heads * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
        q = apply_rope(q.view(b, t, n_heads, head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(b, t, n_kv, head_dim).transpose(1, 2), cos, sin)
        v = v.view(b, t, n_kv, head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_kv != n_heads)
        a = attn.o_proj(a.transpose(1, 2).reshape(b, t, n_heads * head_dim))
        x = x + (F.dropout(a, dropout, True) if train else a)
        h = F.rms_norm(x, (x.shape[-1],), layer.post_attention_layernorm.weight, eps)
        gate, up = F.linear(h, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])).chunk(2, dim=-1)
        m = mlp.down_proj(F.silu(gate) * up)
        x = x + (F.dropout(m, dropout, True) if train else m)
    return F.rms_norm(x, (x.shape[-1],), inner.norm.weight, eps)


def causal_lm_loss(model, input_ids: torch.Tensor, targets: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, dropout: float = 0.0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of ``targets`` (float32 logits, as the reference loop)."""
    h = hidden_states(model, input_ids, cos, sin, dropout, positions)
    logits = model.lm_head(h).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def causal_lm_loss_ul(model, input_ids: torch.Tensor, targets: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, dropout: float, weight: float,
                      positions: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(cross-entropy + weight * unlikelihood, cross-entropy, unlikelihood)."""
    h = hidden_states(model, input_ids, cos, sin, dropout, positions)
    logits = model.lm_head(h).float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    ul = unlikelihood(logits, input_ids, targets)
    return ce + weight * ul, ce, ul


def unlikelihood(logits: torch.Tensor, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-level unlikelihood (Welleck et al. 2019, eq. 4), averaged over positions: at each
    position t, -sum of log(1 - p(c)) over the candidates c, the distinct tokens of the window up
    to and including input t other than the target. It pushes down the probability of repeating
    what the window already holds, which next-token training alone lets a small model loop on.
    logits [B, T, V] float32, input_ids and targets [B, T]."""
    b, t, v = logits.shape
    # first[b, c]: the first position holding token c in window b (t when none): c is a
    # candidate at every position from there on.
    pos = torch.arange(t, device=input_ids.device)
    first = torch.full((b, v), t, dtype=torch.long, device=input_ids.device)
    first = first.scatter_reduce(1, input_ids, pos.expand(b, t), reduce="amin")
    cand = first.unsqueeze(1) <= pos.view(1, t, 1)
    cand = cand.scatter(2, targets.unsqueeze(-1), False)
    p = logits.softmax(-1)
    return -(torch.log1p(-p.clamp(max=1 - 1e-5)) * cand).sum(-1).mean()
