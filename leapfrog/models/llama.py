"""The Llama decoder family: Llama, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm), and
their mixture-of-experts versions (Qwen2-MoE, Qwen3-MoE): a layer whose config.json names experts
gets a sparse feed-forward (layers/moe.py) instead of the dense MLP.

Module names follow the Hugging Face checkpoints (`model.layers.N.self_attn.q_proj`, ...),
except that q/k/v and gate/up are packed; `packed_modules` tells the loader where they go.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leapfrog.layers.attention import Attention, AttnMetadata
from leapfrog.layers.linear import Linear, PackedLinear
from leapfrog.layers.moe import SparseMoE, is_moe_layer, moe_spec
from leapfrog.layers.norm import RMSNorm
from leapfrog.layers.rotary import RotaryEmbedding


class DecoderAttention(nn.Module):
    def __init__(self, cfg: dict, flavour: str) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = cfg.get("attention_bias", cfg.get("qkv_bias", flavour == "qwen2"))
        self.qkv_proj = PackedLinear(hidden, {"q": q_size, "k": kv_size, "v": kv_size}, bias=bias)
        o_bias = cfg.get("attention_bias", False) and flavour != "qwen2"
        self.o_proj = Linear(q_size, hidden, bias=o_bias)
        self.qk_norm = cfg.get("use_qk_norm", flavour == "qwen3")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.get("rms_norm_eps", 1e-6))
            self.k_norm = RMSNorm(self.head_dim, cfg.get("rms_norm_eps", 1e-6))
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttnMetadata | None) -> torch.Tensor:
        lead = x.shape[:-1]
        qkv = self.qkv_proj.forward(x)
        num_qk = self.num_heads + self.num_kv_heads
        qk = qkv[..., :num_qk * self.head_dim].reshape(*lead, num_qk, self.head_dim)
        v = qkv[..., num_qk * self.head_dim:].reshape(*lead, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat([self.q_norm.forward(qk[..., :self.num_heads, :]),
                            self.k_norm.forward(qk[..., self.num_heads:, :])], dim=-2)
        qk = rope.apply(qk)              # q and k heads rotated together: half the ops
        q, k = qk[..., :self.num_heads, :], qk[..., self.num_heads:, :]
        o = self.attn.forward(q, k, v, meta)
        return self.o_proj.forward(o.reshape(*lead, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden, {"0": intermediate, "1": intermediate}, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, flavour: str, layer_idx: int = 0) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = DecoderAttention(cfg, flavour)
        if is_moe_layer(cfg, layer_idx):
            self.mlp = SparseMoE(cfg["hidden_size"], moe_spec(cfg))
        else:
            self.mlp = MLP(cfg["hidden_size"], cfg["intermediate_size"], cfg.get("mlp_bias", False))
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttnMetadata | None) -> torch.Tensor:
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), rope, meta)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: dict, flavour: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(cfg, flavour, i) for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.rotary_emb = RotaryEmbedding(cfg, head_dim, cfg.get("max_position_embeddings", 2048))


class Rope:
    """cos/sin rows for this forward's positions, shared by every layer."""
    __slots__ = ("emb", "cos_sin")

    def __init__(self, emb: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.emb, self.cos_sin = emb, emb.table(positions, dtype)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb.apply(self.cos_sin, x)


class LlamaForCausalLM(nn.Module):
    flavour = "llama"
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "0"), "up_proj": ("gate_up_proj", "1"),
    }

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, self.flavour)
        self.lm_head = Linear(cfg["hidden_size"], cfg["vocab_size"])
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttnMetadata | None = None, capture_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final normed hidden states and the outputs of `capture_layers`
        (layer indices; drafters condition on them)."""
        x = F.embedding(input_ids, self.model.embed_tokens.weight)
        rope = Rope(self.model.rotary_emb, positions, x.dtype)
        captured = []
        # Submodules are called through .forward: leapfrog registers no hooks, and skipping
        # Module.__call__ saves ~0.4 ms per decode step on a small model.
        for i, layer in enumerate(self.model.layers):
            x = layer.forward(x, rope, meta)
            if i in capture_layers:
                captured.append(x)
        return self.model.norm.forward(x), captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.forward(hidden).float()

    @torch.inference_mode()
    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] -> logits [B, T, V]: plain causal forward without a cache (tests, eval)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        hidden, _ = self.forward(input_ids, positions, None)
        return self.compute_logits(hidden)


class Qwen2ForCausalLM(LlamaForCausalLM):
    flavour = "qwen2"


class Qwen3ForCausalLM(LlamaForCausalLM):
    flavour = "qwen3"
