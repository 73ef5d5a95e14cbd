"""Two-stream block diffusion: the AR parent for known tokens, a mask stream for masked ones.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from leapfrog.train.fast import apply_rope

CONFIG_KEY = "diffusion_mask_stream"
PREFIX = "mask_stream."


class MaskStream(nn.Module):
    """The mask tokens' layers: a transformers Llama's decoder layers and final norm (same
    names under ``mask_stream.``), and the vector a mask token enters with."""

    def __init__(self, config) -> None:
        super().__init__()
        # deferred: transformers is heavy and loads only when a stream is built
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(config.hidden_size))


def attach(model, source=None, mask_id: int = 0) -> MaskStream:
    """Freeze ``model`` (the parent) and give it a mask stream, copied from the block-diffusion
    model ``source`` (its layers, final norm and the mask token's embedding) or, without one,
    from the parent itself with the mask token's embedding."""
    for p in model.parameters():
        p.requires_grad_(False)
    stream = MaskStream(model.config).to(model.dtype)
    if source is None:
        source = model
    else:
        for a in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_key_value_heads"):
            if getattr(source.config, a) != getattr(model.config, a):
                raise ValueError(f"{source.name_or_path}: {a} differs from the parent's; the mask stream must have its shape")
    with torch.no_grad():
        stream.layers.load_state_dict(source.model.layers.state_dict())
        stream.norm.load_state_dict(source.model.norm.state_dict())
        stream.mask_embedding.copy_(source.model.embed_tokens.weight[mask_id].float())
    for p in stream.parameters():
        p.requires_grad_(True)
    model.mask_stream = stream
    model.config.update({CONFIG_KEY: True})
    return stream


def hidden_states(model, input_ids: torch.Tensor, position_ids: torch.Tensor, attn_mask: torch.Tensor,
                  mask_id: int) -> torch.Tensor:
    """[R, S, H] final normed hidden states of the two-stream model on packed rows;
    ``attn_mask`` [R, 1, S, S] bool (True = may attend). Rows are regrouped so that each
    projection runs once per stream: known rows first, then mask rows."""
    stream: MaskStream = model.mask_stream
    cfg = model.config
    r, s = input_ids.shape
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    flat = input_ids.reshape(-1)
    is_mask = flat == mask_id
    perm = torch.cat([(~is_mask).nonzero().flatten(), is_mask.nonzero().flatten()])
    inv = torch.argsort(perm)
    k = int((~is_mask).sum())

    def both(fp, fm, x):          # x in perm order
        return torch.cat([fp(x[:k]), fm(x[k:])])

    emb = model.model.embed_tokens(flat)
    x = torch.where(is_mask[:, None], stream.mask_embedding.to(emb.dtype), emb)[perm]
    cos, sin = model.model.rotary_emb(emb.view(r, s, -1), position_ids)
    cos, sin = cos.reshape(r * s, 1, dim)[perm], sin.reshape(r * s, 1, dim)[perm]
    for lp, lm in zip(model.model.layers, stream.layers):
        h = both(lp.input_layernorm, lm.input_layernorm, x)
        ap, am = lp.self_attn, lm.self_attn
        q = both(ap.q_proj, am.q_proj, h).view(-1, heads, dim)
        kk = both(ap.k_proj, am.k_proj, h).view(-1, kv_heads, dim)
        v = both(ap.v_proj, am.v_proj, h).view(-1, kv_heads, dim)
        q, kk = apply_rope(q, cos, sin), apply_rope(kk, cos, sin)
        # back to sequence order for attention
        q, kk, v = (t[inv].view(r, s, -1, dim).transpose(1, 2) for t in (q, kk, v))
        o = F.scaled_dot_product_attention(q, kk, v, attn_mask=attn_mask, scale=dim ** -0.5,
                                           enable_gqa=kv_heads != heads)
        o = o.transpose(1, 2).reshape(r * s, heads * dim)[perm]
        x = x + both(ap.o_proj, am.o_proj, o)
        h = both(lp.post_attention_layernorm, lm.post_attention_layernorm, x)
        x = x + both(lp.mlp, lm.mlp, h)
    return both(model.model.norm, stream.norm, x)[inv].view(r, s, -1)


def state(model) -> dict[str, torch.Tensor]:
    """The mask stream's tensors by checkpoint name."""
    return {PREFIX + n: t for n, t in model.mask_stream.state_dict().items()}


def from_folder(folder) -> "torch.nn.Module":
    """A two-stream checkpoint as a transformers Llama with its mask stream attached (the
    reference for the engine's forward, and a run's starting point)."""
    # deferred: safetensors and transformers load only when a checkpoint is read
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    weights = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        weights.update({k[len(PREFIX):]: v for k, v in load_file(f).items() if k.startswith(PREFIX)})
    stream = attach(model, None, 0)
    missing, unexpected = stream.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder}: mask stream tensors do not fit (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.eval()


def block_rule_mask(ids: torch.Tensor, block_size: int, mask_id: int) -> torch.Tensor:
    """[1, 1, T, T] bool for one sequence: mask rows see their block and everything before it,
    other rows are causal."""
    t = ids.shape[-1]
    pos = torch.arange(t)
    causal = pos[None, :] <= pos[:, None]
    block = (pos[None, :] // block_size) <= (pos[:, None] // block_size)
    return torch.where((ids.reshape(-1) == mask_id)[:, None], block, causal)[None, None]
