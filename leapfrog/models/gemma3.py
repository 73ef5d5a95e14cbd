"""Gemma 3 (text): the Llama decoder with Gemma's changes. Embeddings scaled by sqrt(hidden);
four RMSNorms a layer (before and after attention, before and after the MLP); per-head q/k
RMSNorm; a GeGLU MLP (tanh-approximated GELU); attention scaled by query_pre_attn_scalar; and
local layers, which attend within a sliding window and rotate with their own base, between
global ones (five to one in the released models).

Norm weights are kept as the scale they apply. Hugging Face stores w and scales by (1 + w): its
checkpoints load through `shifted_loader`, which adds the 1 (a GGUF file stores 1 + w, and its
reader hands over w, as transformers' does).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leapfrog.layers import parallel as tp
from leapfrog.layers.attention import AttnMetadata, StepInterrupted
from leapfrog.layers.linear import default_weight_loader
from leapfrog.layers.norm import RMSNorm
from leapfrog.layers.rotary import RotaryEmbedding
from leapfrog.models.llama import MLP, DecoderAttention, DecoderLayer, LlamaForCausalLM, Rope

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
# Gemma 3's released models: every sixth layer global, the rest local
DEFAULT_PATTERN = 6


def layer_types(cfg: dict) -> list[str]:
    """"sliding_attention" or "full_attention" per layer, from `layer_types` or the older
    `sliding_window_pattern`."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != n or any(t not in ("sliding_attention", "full_attention") for t in types):
            raise ValueError(f"layer_types must list {n} entries of 'sliding_attention' or 'full_attention'")
        return list(types)
    every = int(cfg.get("sliding_window_pattern") or DEFAULT_PATTERN)
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]


def rope_configs(cfg: dict) -> dict[str, dict]:
    """The rotary settings of each layer type as a config of their own. transformers >= 5 writes
    `rope_parameters` by layer type; older configs give the global layers rope_theta and
    rope_scaling, the local ones rope_local_base_freq and no scaling."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        return {kind: {"rope_parameters": dict(params[kind])} for kind in ("full_attention", "sliding_attention")}
    return {"full_attention": {"rope_theta": cfg.get("rope_theta", 1_000_000.0), "rope_scaling": cfg.get("rope_scaling")},
            "sliding_attention": {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}}


def shifted_loader(param: nn.Parameter, tensor: torch.Tensor, shard_id: object = None) -> None:
    """A Gemma norm weight w as the scale 1 + w it applies."""
    default_weight_loader(param, tensor + 1, shard_id)


def gemma_norm(dim: int, eps: float) -> RMSNorm:
    norm = RMSNorm(dim, eps)
    norm.weight.weight_loader = shifted_loader
    return norm


class GeGLU(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        out = self.down_proj.forward(F.gelu(gate, approximate="tanh").mul_(up))
        return tp.all_reduce(out) if self.split else out


class Gemma3DecoderLayer(nn.Module):
    activation = ("hidden_activation", ACTIVATIONS, "gelu_pytorch_tanh")
    fusable = False              # the one-layer C++ call computes the Llama layer only
    loopable = True              # the decode loop computes this one (DecodeLoop.set_gemma)

    def __init__(self, cfg: dict, flavour: str, layer_idx: int = 0) -> None:
        super().__init__()
        eps, hidden = cfg.get("rms_norm_eps", 1e-6), cfg["hidden_size"]
        self.sliding = layer_types(cfg)[layer_idx] == "sliding_attention"
        self.self_attn = DecoderAttention({**cfg, "use_qk_norm": True}, flavour)
        self.self_attn.attn.scale = float(cfg.get("query_pre_attn_scalar") or self.self_attn.head_dim) ** -0.5
        self.self_attn.attn.window = int(cfg.get("sliding_window") or 0) if self.sliding else 0
        for norm in (self.self_attn.q_norm, self.self_attn.k_norm):
            norm.weight.weight_loader = shifted_loader
        self.mlp = GeGLU(hidden, cfg["intermediate_size"])
        self.input_layernorm = gemma_norm(hidden, eps)
        self.post_attention_layernorm = gemma_norm(hidden, eps)
        self.pre_feedforward_layernorm = gemma_norm(hidden, eps)
        self.post_feedforward_layernorm = gemma_norm(hidden, eps)

    @property
    def ffn_norm(self) -> RMSNorm:
        return self.pre_feedforward_layernorm

    _fused_weights = DecoderLayer._fused_weights     # the decode loop's weight list

    def forward(self, x: torch.Tensor, rope: "GemmaRope", meta: AttnMetadata | None) -> torch.Tensor:
        h = self.self_attn.forward(self.input_layernorm.forward(x), rope.local if self.sliding else rope.full, meta)
        x = x + self.post_attention_layernorm.forward(h)
        h = self.mlp.forward(self.pre_feedforward_layernorm.forward(x))
        return x + self.post_feedforward_layernorm.forward(h)


class GemmaRope:
    """The rotary rows of a forward's positions for both kinds of layer."""
    __slots__ = ("local", "full")

    def __init__(self, local: Rope, full: Rope) -> None:
        self.local, self.full = local, full


class Gemma3ForCausalLM(LlamaForCausalLM):
    flavour = "gemma3"
    layer_class = Gemma3DecoderLayer

    def __init__(self, cfg: dict) -> None:
        if not cfg.get("tie_word_embeddings", True):
            raise ValueError("tie_word_embeddings must be true for Gemma 3 (its head is the embedding)")
        cfg = {**cfg, "tie_word_embeddings": True}
        super().__init__(cfg)
        self.model.norm.weight.weight_loader = shifted_loader
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        max_pos = cfg.get("max_position_embeddings", 2048)
        kinds = rope_configs(cfg)
        self.model.rotary_emb = RotaryEmbedding(kinds["full_attention"], head_dim, max_pos)
        self.model.local_rotary_emb = RotaryEmbedding(kinds["sliding_attention"], head_dim, max_pos)
        self.embed_scale = float(cfg["hidden_size"]) ** 0.5
        self.softcap = cfg.get("final_logit_softcapping")

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> GemmaRope:
        return GemmaRope(Rope(self.model.local_rotary_emb, positions, dtype), Rope(self.model.rotary_emb, positions, dtype))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        # the scale rounded to the activations' type first, as Hugging Face's Gemma does
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def _layers(self, x: torch.Tensor, rope: GemmaRope, meta: AttnMetadata | None, layer_ids: range,
                capture_layers: tuple[int, ...], fused: bool) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        captured = {}
        for i in layer_ids:
            if meta is not None and meta.interrupted():
                raise StepInterrupted
            x = self.model.layers[i].forward(x, rope, meta)
            if i in capture_layers:
                captured[i] = x
        return x, captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap).mul_(self.softcap)
        return logits

    def decode_loop(self, block_size: int):
        """The C++ decode loop with Gemma's layer (DecodeLoop.set_gemma); none with a final logit
        soft-cap (Gemma 2's), which the loop's head does not apply."""
        return None if self.softcap else super().decode_loop(block_size)

    def configure_loop(self, loop) -> None:
        super().configure_loop(loop)
        layers = self.model.layers
        loop.set_gemma([layer.post_attention_layernorm.weight.detach() for layer in layers],
                       [layer.post_feedforward_layernorm.weight.detach() for layer in layers],
                       [layer.self_attn.attn.window for layer in layers], [layer.sliding for layer in layers],
                       self.model.local_rotary_emb.cos, self.model.local_rotary_emb.sin, self.embed_scale)
