"""A two-stream block-diffusion model's mask stream (leapfrog/train/mask_stream.py has the model
and its training): rows whose input is the mask token run these layers instead of the model's
own, and attend to their whole block (the runner's ``attn_bidir_token`` rule); every other row
runs the AR model unchanged and causally. Both streams write the same KV cache.

The checkpoint is the AR model's folder with ``mask_stream.layers.N.*`` (Llama names),
``mask_stream.norm.weight`` and ``mask_stream.mask_embedding`` added and
``"diffusion_mask_stream": true`` in config.json.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from leapfrog.layers import parallel as tp
from leapfrog.layers.cpu_kernels import cpu_kernels
from leapfrog.layers.norm import RMSNorm

if TYPE_CHECKING:
    from leapfrog.layers.attention import AttnMetadata

CONFIG_KEY = "diffusion_mask_stream"


def has_mask_stream(cfg: dict) -> bool:
    value = cfg.get(CONFIG_KEY, False)
    if not isinstance(value, bool):
        raise ValueError(f"{CONFIG_KEY}={value!r} must be true or false")
    if value and tp.pp_size() > 1:
        raise ValueError(f"{CONFIG_KEY}: a two-stream diffusion model does not run in pipeline stages "
                         "(tensor parallelism splits both streams' heads and columns)")
    if value and not isinstance(cfg.get("mask_token_id"), int):
        raise ValueError(f"{CONFIG_KEY} needs mask_token_id")
    return value


class MaskStream(nn.Module):
    def __init__(self, cfg: dict, layer_factory: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer_factory(i) for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))
        self.mask_embedding = nn.Parameter(torch.zeros(cfg["hidden_size"]))
        if any(not layer.fusable for layer in self.layers):
            raise ValueError(f"{CONFIG_KEY}: the mask stream needs dense layers (no experts)")


def forward(model, emb: torch.Tensor, positions: torch.Tensor, meta: "AttnMetadata",
            is_mask: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """Final normed hidden states [T, H] of a forward (``emb``: the rows' embeddings [T, H])
    whose rows ``is_mask`` [T] run the mask stream. Rows are regrouped (known rows first) so
    that every projection runs once per stream; attention, which writes the cache by slot, sees
    them in their own order. ``fused``: the layers as C++ calls (few rows read straight from the
    paged cache, float32 CPU inference), where every row's metadata follows the regrouping."""
    stream: MaskStream = model.mask_stream
    shape, pos = emb.shape, positions.reshape(-1)
    emb = emb.reshape(-1, shape[-1])
    perm = torch.cat([(~is_mask).nonzero().flatten(), is_mask.nonzero().flatten()])
    inv = torch.argsort(perm)
    k = int(perm.shape[0] - is_mask.sum())

    def both(own, masked, x: torch.Tensor) -> torch.Tensor:
        if k == 0:
            return masked(x)
        if k == x.shape[0]:
            return own(x)
        return torch.cat([own(x[:k]), masked(x[k:])])

    x = torch.where(is_mask.unsqueeze(-1), stream.mask_embedding.to(emb.dtype), emb)[perm]
    rotary = model.model.rotary_emb
    cos_sin = rotary.table(pos[perm], x.dtype)
    if fused and tp.tp_size() == 1:      # a tensor-parallel rank takes the layer-by-layer path
        x = _fused_layers(model, x, cos_sin, meta, perm, k)
        return both(model.model.norm.forward, stream.norm.forward, x)[inv].view(shape)
    for lp, lm in zip(model.model.layers, stream.layers):
        ap, am = lp.self_attn, lm.self_attn
        h = both(lp.input_layernorm.forward, lm.input_layernorm.forward, x)
        qkv = both(ap.qkv_proj.forward, am.qkv_proj.forward, h)
        num_qk = ap.num_heads + ap.num_kv_heads
        qk = qkv[:, :num_qk * ap.head_dim].reshape(-1, num_qk, ap.head_dim)
        v = qkv[:, num_qk * ap.head_dim:].reshape(-1, ap.num_kv_heads, ap.head_dim)
        if ap.qk_norm:
            def norms(a):
                return lambda t: torch.cat([a.q_norm.forward(t[:, :a.num_heads]),
                                            a.k_norm.forward(t[:, a.num_heads:])], dim=1)
            qk = both(norms(ap), norms(am), qk)
        qk = rotary.apply(cos_sin, qk)
        q, kk = qk[:, :ap.num_heads][inv], qk[:, ap.num_heads:][inv]
        a = ap.attn.forward(q, kk, v[inv], meta).reshape(q.shape[0], -1)[perm]
        o = both(ap.o_proj.forward, am.o_proj.forward, a)
        x = x + (tp.all_reduce(o) if ap.split else o)      # the MLPs all-reduce their own sums
        h = both(lp.post_attention_layernorm.forward, lm.post_attention_layernorm.forward, x)
        x = x + both(lp.mlp.forward, lm.mlp.forward, h)
    return both(model.model.norm.forward, stream.norm.forward, x)[inv].view(shape)


def _fused_layers(model, x: torch.Tensor, cos_sin, meta: "AttnMetadata", perm: torch.Tensor,
                  k: int) -> torch.Tensor:
    """Every layer as one C++ call (cpu_kernels.two_stream_layer) on the regrouped rows."""
    g, t = meta.groups[0], x.shape[0]
    cos, sin = cos_sin[0].reshape(t, -1), cos_sin[1].reshape(t, -1)
    slots, tables, lens = meta.slot_mapping[perm], g.block_tables[perm], g.ctx_lens[perm]
    kernels = cpu_kernels()
    for lp, lm in zip(model.model.layers, model.mask_stream.layers):
        a = lp.self_attn
        x = kernels.two_stream_layer(
            x, lp._fused_weights(), lm._fused_weights(), k, cos, sin, a.attn.k_cache, a.attn.v_cache,
            slots, tables, lens, g.block_size, a.num_heads, a.num_kv_heads, a.head_dim, a.attn.scale,
            lp.input_layernorm.eps, a.q_norm.eps if a.qk_norm else 0.0)
    return x
