"""DFlash / DSpark drafter backbone (DFlash: "DFlash: Block Diffusion for Flash Speculative
Decoding", Chen et al. 2026; the DSpark paper's semi-autoregressive drafter).
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from leapfrog.layers.cpu_kernels import cpu_inference, cpu_kernels
from leapfrog.layers.linear import Linear, kernel_bias, kernel_weight, skinny_rows_max
from leapfrog.layers.norm import RMSNorm
from leapfrog.layers.rotary import RotaryEmbedding
from leapfrog.models import llama
from leapfrog.models.llama import DecoderLayer, LlamaForCausalLM


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default taps (their DFlash release): the middle layer for one draft layer, else evenly from
    layer 1 to layer L-3 (never the last: HF returns it normed)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(slots=True)
class DrafterConfig:
    """The keys a DFlash or DSpark config.json carries beyond the Qwen3 ones (the z-lab
    DFlash and DeepSpec DSpark releases)."""
    kind: str                      # "dflash": anchor + B-1 masks -> B-1 drafts; "dspark": B -> B
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    confidence_temperatures: list[float] | None = None   # leapfrog's key for fitted STS temperatures
    # leapfrog's key `draft_from_anchor`: false puts a DSpark drafter on DFlash's block (anchor +
    # B-1 masks, draft 1 from the first mask's slot) instead of DeepSpec's (draft 1 from the anchor's).
    draft_from_anchor: bool = True

    @property
    def num_draft_tokens(self) -> int:
        # DSpark makes the anchor slot its first prediction; DFlash reads slots 1..B-1.
        return self.block_size if self.kind == "dspark" and self.draft_from_anchor else self.block_size - 1

    @classmethod
    def from_hf(cls, cfg: dict) -> "DrafterConfig":
        """Read and check the keys; a wrong type or value is a ValueError naming the key, so a
        broken drafter is refused at load time instead of failing a request later."""
        archs = cfg.get("architectures") or []
        kind = "dspark" if any("DSpark" in a for a in archs) or "markov_rank" in cfg else "dflash"
        sub = cfg.get("dflash_config") or {}
        # Newer DFlash drafters keep block_size inside dflash_config only.
        block = cfg.get("block_size", sub.get("block_size"))
        mask = sub.get("mask_token_id", cfg.get("mask_token_id"))
        taps = sub.get("target_layer_ids", cfg.get("target_layer_ids"))
        if block is None or mask is None:
            raise ValueError("drafter config.json needs block_size and mask_token_id "
                             "(top level or in dflash_config)")
        if taps is None:
            taps = build_target_layer_ids(_int(cfg.get("num_target_layers"), "num_target_layers", 1),
                                          _int(cfg.get("num_hidden_layers"), "num_hidden_layers", 1))
        if not isinstance(taps, list) or not taps:
            raise ValueError(f"target_layer_ids must be a non-empty list of layer indices, not {taps!r}")
        temps = cfg.get("confidence_temperatures")
        if temps is not None and (not isinstance(temps, list) or not all(
                isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < float("inf") for t in temps)):
            raise ValueError(f"confidence_temperatures must be a list of positive numbers, not {temps!r}")
        d = cls(kind, _int(block, "block_size", 1), _int(mask, "mask_token_id", 0),
                [_int(t, "target_layer_ids", 0) for t in taps],
                _int(cfg.get("markov_rank", 0) or 0, "markov_rank", 0), str(cfg.get("markov_head_type", "vanilla")),
                _flag(cfg, "enable_confidence_head", False), _flag(cfg, "confidence_head_with_markov", True),
                [float(t) for t in temps] if temps is not None else None, _flag(cfg, "draft_from_anchor", True))
        if d.num_draft_tokens < 1:
            raise ValueError(f"block_size {d.block_size} leaves no draft for a {kind} drafter")
        vocab = cfg.get("vocab_size")
        if isinstance(vocab, int) and d.mask_token_id >= vocab:
            raise ValueError(f"mask_token_id {d.mask_token_id} is outside the vocabulary ({vocab})")
        return d


def _int(value, key: str, least: int) -> int:
    """A JSON integer >= least (an integral float such as 9.0 passes; true, "9" and [9] do not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{key} must be an integer, not {value!r}")
    if value < least:
        raise ValueError(f"{key} must be at least {least}, not {value!r}")
    return int(value)


def _flag(cfg: dict, key: str, default: bool) -> bool:
    """A JSON true/false (absent or null: the default); the string "false" is refused, not read
    as true."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, not {value!r}")
    return value


@dataclass(slots=True)
class DraftContext:
    """Per-sequence draft KV: one [n, kv_heads, head_dim] pair per draft layer for the
    committed positions start..start+n-1. Only kept (committed) positions are ever appended,
    so a rejected draft never needs rolling back here."""
    start: int
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    # Fused-feature rows [n, m*d] of positions after the keys, not projected yet: a request that
    # is not drafting (under load) only queues them, and the next draft projects every queued
    # row of its batch in one pass (DFlashDraftModel.flush_contexts).
    pending: list[torch.Tensor] = field(default_factory=list)
    num_pending: int = 0

    @property
    def num_keys(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def num_positions(self) -> int:
        return self.num_keys + self.num_pending


class ContextCache:
    """Draft K/V of finished (or preempted) sequences, reused when a new sequence starts after
    a prefix-cache hit: the target then skips the cached prefix and produces no features for
    it, but the features of position i depend only on tokens[:i+1], so any earlier sequence
    with the same prefix has them. LRU, bounded by total cached positions."""

    def __init__(self, max_positions: int = 1 << 15) -> None:
        self.max_positions = max_positions
        self.entries: OrderedDict[int, tuple[list[int], DraftContext]] = OrderedDict()
        self._next = 0

    def put(self, token_ids: list[int], ctx: DraftContext | None) -> None:
        if ctx is None or ctx.start != 0 or ctx.num_positions == 0:
            return
        self.entries[self._next] = (list(token_ids[:ctx.num_positions]), ctx)
        self._next += 1
        while sum(c.num_positions for _, c in self.entries.values()) > self.max_positions:
            self.entries.popitem(last=False)

    def get(self, token_ids: list[int], n: int,
            flush: Callable[[list[DraftContext]], None] | None = None) -> DraftContext | None:
        """A context for positions 0..n-1 of `token_ids`, or None. Entries may hold queued,
        unprojected rows (a request that finished while not drafting is stored as it was, so
        finishing costs nothing): `flush` projects them when such an entry is reused; without
        it only an entry's projected keys count."""
        for key in reversed(self.entries):
            toks, ctx = self.entries[key]
            if len(toks) < n or toks[:n] != token_ids[:n]:
                continue
            if ctx.num_keys < n and ctx.pending and flush is not None:
                flush([ctx])
            if ctx.num_keys < n:
                continue
            self.entries.move_to_end(key)
            return DraftContext(0, [k[:n] for k in ctx.keys], [v[:n] for v in ctx.values])
        return None


class DFlashDraftModel(nn.Module):
    packed_modules = LlamaForCausalLM.packed_modules

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.config = cfg
        self.drafter = DrafterConfig.from_hf(cfg)
        d = cfg["hidden_size"]
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.layers = nn.ModuleList(DecoderLayer(cfg, "qwen3") for _ in range(cfg["num_hidden_layers"]))
        # A drafter narrower than its target (leapfrog's `target_hidden_size`): fc reads the
        # target's wider features, and the embedding and LM head, which the drafter otherwise
        # borrows from the target, are its own at its width.
        self.target_hidden_size = int(cfg.get("target_hidden_size", d))
        self.fc = Linear(len(self.drafter.target_layer_ids) * self.target_hidden_size, d)
        self.embed_tokens: nn.Embedding | None = None
        self.lm_head: Linear | None = None
        if self.target_hidden_size != d:
            self.embed_tokens = nn.Embedding(cfg["vocab_size"], d)
            self.lm_head = Linear(d, cfg["vocab_size"])
            if cfg.get("tie_word_embeddings", False):
                self.lm_head.weight = self.embed_tokens.weight
        self.hidden_norm = RMSNorm(d, eps)
        self.norm = RMSNorm(d, eps)
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.max_positions = cfg.get("max_position_embeddings", 2048)
        self.rotary_emb = RotaryEmbedding(cfg, self.head_dim, self.max_positions)
        self.markov_head: nn.Module | None = None
        self.confidence_head: nn.Module | None = None
        if self.drafter.kind == "dspark":
            # deferred: dflash_heads loads only for DSpark drafters
            from leapfrog.models.dflash_heads import build_heads
            self.markov_head, self.confidence_head = build_heads(self.drafter, d, cfg["vocab_size"])

    # --- vocabulary: the drafter's own (narrow drafter) or the target's ----------------------
    def embed(self, ids: torch.Tensor, target: nn.Module) -> torch.Tensor:
        if self.embed_tokens is not None:
            return F.embedding(ids, self.embed_tokens.weight)
        if hasattr(target, "embed"):          # the target's (its vocabulary split over ranks)
            return target.embed(ids)
        return F.embedding(ids, target.model.embed_tokens.weight)

    def compute_logits(self, hidden: torch.Tensor, target: nn.Module) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head.forward(hidden).float()
        return target.compute_logits(hidden)

    # --- context K/V ---------------------------------------------------------------------------
    def _kv(self, layer: DecoderLayer, h: torch.Tensor, rope: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        a = layer.self_attn
        _, k, v = a.qkv_proj.split(a.qkv_proj.forward(h))
        k = a.k_norm.forward(k.unflatten(-1, (self.num_kv_heads, self.head_dim)))
        return self.rotary_emb.apply(rope, k), v.unflatten(-1, (self.num_kv_heads, self.head_dim))

    def extend_context(self, ctx: DraftContext, features: torch.Tensor) -> None:
        """Append the target features [n, m*d] of the next n committed positions, now."""
        self.queue_context(ctx, features)
        self.flush_contexts([ctx])

    @staticmethod
    def queue_context(ctx: DraftContext, features: torch.Tensor) -> None:
        """Queue the target features [n, m*d] of the next n committed positions."""
        if features.shape[0]:
            ctx.pending.append(features)
            ctx.num_pending += features.shape[0]

    def flush_contexts(self, contexts: list[DraftContext]) -> None:
        """Project every queued feature row of `contexts` into draft K/V, in one pass."""
        todo = [c for c in contexts if c.pending]
        if not todo:
            return
        feats = torch.cat([f for c in todo for f in c.pending])
        pos = torch.cat([torch.arange(c.num_keys, c.num_positions, device=feats.device) + c.start for c in todo])
        rope = self.rotary_emb.table(pos.clamp(max=self.max_positions - 1), feats.dtype)
        counts = [c.num_pending for c in todo]
        kv = self._fused_context_kv(feats, rope)
        if kv is None:
            h = self.hidden_norm.forward(self.fc.forward(feats))
            kv = [t for layer in self.layers for t in self._kv(layer, h, rope)]
        for i in range(len(self.layers)):
            k, v = kv[2 * i], kv[2 * i + 1]
            for c, kc, vc in zip(todo, k.split(counts), v.split(counts)):
                if len(c.keys) <= i:
                    c.keys.append(kc)
                    c.values.append(vc)
                else:
                    c.keys[i] = torch.cat([c.keys[i], kc])
                    c.values[i] = torch.cat([c.values[i], vc])
        for c in todo:
            c.pending.clear()
            c.num_pending = 0

    def _fused_context_kv(self, feats: torch.Tensor, rope: tuple) -> list[torch.Tensor] | None:
        """Context K/V of a few rows as one C++ call (CPU float32 inference, the few-row kernel's
        sizes): [k_0, v_0, k_1, v_1, ...]; None where it does not apply."""
        if feats.dim() != 2 or feats.shape[0] > skinny_rows_max() or not _fused_ok(feats, self.layers):
            return None
        attn = [layer.self_attn for layer in self.layers]
        cos, sin = rope
        n = feats.shape[0]
        return cpu_kernels().context_kv(
            feats, kernel_weight(self.fc), kernel_bias(self.fc), self.hidden_norm.weight, self.hidden_norm.eps,
            [kernel_weight(a.qkv_proj) for a in attn], [kernel_bias(a.qkv_proj) for a in attn],
            [a.k_norm.weight if a.qk_norm else torch.empty(0) for a in attn],
            cos.reshape(n, -1), sin.reshape(n, -1), self.num_heads, self.num_kv_heads, self.head_dim,
            attn[0].k_norm.eps if attn[0].qk_norm else 0.0)

    # --- the block forward -----------------------------------------------------------------
    def forward(self, embeds: torch.Tensor, anchor_pos: torch.Tensor,
                contexts: list[DraftContext]) -> torch.Tensor:
        """embeds [B, L, d] of [anchor, MASK...]; anchor_pos [B]. Returns normed hidden [B, L, d]."""
        b, length, _ = embeds.shape
        pos = (anchor_pos.unsqueeze(1) + torch.arange(length, device=embeds.device)).clamp(max=self.max_positions - 1)
        rope = self.rotary_emb.table(pos, embeds.dtype)
        ctx_len = max(c.num_positions for c in contexts)
        x = embeds
        if all(c.num_keys for c in contexts) and _fused_ok(x, self.layers):
            # CPU inference: each sequence's block through each layer as one C++ call, its
            # context as is (no padding, no mask); the drafts of a sequence do not depend on
            # the batch it is drafted in.
            out = []
            for j, ctx in enumerate(contexts):
                xj = x[j]
                cos, sin = rope[0][j].reshape(length, -1), rope[1][j].reshape(length, -1)
                for i, layer in enumerate(self.layers):
                    a = layer.self_attn
                    xj = cpu_kernels().draft_layer(
                        xj, layer._fused_weights(), cos, sin, ctx.keys[i], ctx.values[i], self.num_heads,
                        self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, layer.input_layernorm.eps,
                        a.q_norm.eps if a.qk_norm else 0.0)
                out.append(xj)
            return self.norm.forward(torch.stack(out))
        if b == 1 and ctx_len > 0:     # one sequence: its context as is, no padding, no mask
            ctx = contexts[0]
            for i, layer in enumerate(self.layers):
                x = self._layer(layer, x, rope, ctx.keys[i][None], ctx.values[i][None], None)
            return self.norm.forward(x)
        lens = torch.tensor([c.num_positions for c in contexts], device=embeds.device)
        valid = (torch.arange(ctx_len, device=embeds.device) < lens.unsqueeze(1)).view(b, 1, 1, ctx_len)
        # Block queries see every context key before the anchor and their whole block (DFlash).
        mask = torch.cat([valid.expand(b, 1, length, ctx_len),
                          torch.ones(b, 1, length, length, dtype=torch.bool, device=embeds.device)], dim=-1)
        for i, layer in enumerate(self.layers):
            ck = _pad([c.keys[i] if c.keys else None for c in contexts], ctx_len, self.num_kv_heads, embeds)
            cv = _pad([c.values[i] if c.values else None for c in contexts], ctx_len, self.num_kv_heads, embeds)
            x = self._layer(layer, x, rope, ck, cv, mask)
        return self.norm.forward(x)

    def _layer(self, layer: DecoderLayer, x: torch.Tensor, rope: tuple, ck: torch.Tensor,
               cv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        a = layer.self_attn
        h = layer.input_layernorm.forward(x)
        q, k, v = a.qkv_proj.split(a.qkv_proj.forward(h))
        q = a.q_norm.forward(q.unflatten(-1, (self.num_heads, self.head_dim)))
        k = a.k_norm.forward(k.unflatten(-1, (self.num_kv_heads, self.head_dim)))
        q, k = self.rotary_emb.apply(rope, q), self.rotary_emb.apply(rope, k)
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        keys, values = torch.cat([ck, k], dim=1), torch.cat([cv, v], dim=1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
            scale=self.head_dim ** -0.5, enable_gqa=self.num_kv_heads != self.num_heads)
        x = x + a.o_proj.forward(o.transpose(1, 2).flatten(-2))
        return x + layer.mlp.forward(layer.post_attention_layernorm.forward(x))


def _fused_ok(x: torch.Tensor, layers) -> bool:
    """Blocks on a CPU without autograd (neither the input nor the drafter's weights need it:
    training runs the torch path), dense SwiGLU layers: the layers may run as single C++ calls
    (models/llama.py's fused path, for the drafter)."""
    return (llama._FUSED_LAYERS and cpu_inference(x, layers[0].self_attn.qkv_proj.weight)
            and cpu_kernels() is not None and all(layer.fusable for layer in layers))


def _pad(parts: list[torch.Tensor | None], length: int, heads: int, like: torch.Tensor) -> torch.Tensor:
    """Stack per-sequence [n_i, heads, D] into [B, length, heads, D] (zeros past n_i, masked)."""
    dim = next((p.shape[-1] for p in parts if p is not None), 1)
    out = torch.zeros(len(parts), length, heads, dim, dtype=like.dtype, device=like.device)
    for i, p in enumerate(parts):
        if p is not None:
            out[i, :p.shape[0]] = p
    return out
