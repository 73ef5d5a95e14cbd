"""The Llama decoder family: Llama, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm), and
their mixture-of-experts versions (Qwen2-MoE, Qwen3-MoE): a layer whose config.json names experts
gets a sparse feed-forward (layers/moe.py) instead of the dense MLP.

Module names follow the Hugging Face checkpoints (`model.layers.N.self_attn.q_proj`, ...),
except that q/k/v and gate/up are packed; `packed_modules` tells the loader where they go.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from leapfrog.layers import parallel as tp
from leapfrog.layers.attention import Attention, AttnMetadata, StepInterrupted
from leapfrog.layers.cpu_kernels import NO_FLAG, cpu_inference, cpu_kernels
from leapfrog.layers.linear import (Linear, PackedLinear, embedding_panels, kernel_bias, kernel_panels,
                                    kernel_weight,
                                    skinny_rows_max)
from leapfrog.layers.moe import SparseMoE, is_moe_layer, moe_spec
from leapfrog.layers.norm import RMSNorm
from leapfrog.layers.rotary import RotaryEmbedding, coupled_positions
from leapfrog.models import mask_stream


class DecoderAttention(nn.Module):
    """Under tensor parallelism this rank's heads (and KV heads) only: q/k/v column-parallel,
    o_proj row-parallel, one all-reduce after it."""

    def __init__(self, cfg: dict, flavour: str) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        self.head_dim = cfg.get("head_dim") or hidden // heads
        self.num_heads = tp.shard(heads, "num_attention_heads")[1]
        self.num_kv_heads = tp.shard(kv_heads, "num_key_value_heads")[1]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = cfg.get("attention_bias", cfg.get("qkv_bias", flavour == "qwen2"))
        self.split = split = tp.tp_size() > 1      # built as a shard: its output is summed over ranks
        self.qkv_proj = PackedLinear(hidden, {"q": q_size, "k": kv_size, "v": kv_size}, bias=bias,
                                     column_parallel=split)
        o_bias = cfg.get("attention_bias", False) and flavour != "qwen2"
        self.o_proj = Linear(q_size, hidden, bias=o_bias, parallel="row" if split else None)
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
        o = self.o_proj.forward(self.attn.forward(q, k, v, meta).reshape(*lead, -1))
        return tp.all_reduce(o) if self.split else o


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.split = split = tp.tp_size() > 1   # this rank's columns of gate/up and rows of down
        local = tp.shard(intermediate, "intermediate_size")[1]
        self.gate_up_proj = PackedLinear(hidden, {"0": local, "1": local}, bias=bias, column_parallel=split)
        self.down_proj = Linear(local, hidden, bias=bias, parallel="row" if split else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        out = self.down_proj.forward(F.silu(gate).mul_(up))
        return tp.all_reduce(out) if self.split else out


# The MLP computes SiLU(gate) * up; HF's ACT2FN has "swish" as another name for it.
SUPPORTED_ACTIVATIONS = ("silu", "swish")


def sliding_window(cfg: dict, layer_idx: int) -> int:
    """The sliding window of a layer as transformers reads the config (0: full attention).
    Mistral: every layer, when `sliding_window` is set. Qwen2/3 (and their MoE): `layer_types`,
    else the layers from `max_window_layers` on, when `use_sliding_window`. Llama has none. A
    window as long as the context changes nothing and is left off."""
    window = int(cfg.get("sliding_window") or 0)
    kind = cfg.get("model_type", "")
    if window <= 0 or window >= int(cfg.get("max_position_embeddings", 1 << 62)):
        return 0
    types = cfg.get("layer_types")
    if kind == "mistral":
        return window if types is None or types[layer_idx] == "sliding_attention" else 0
    if kind in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if types is not None:
            return window if types[layer_idx] == "sliding_attention" else 0
        if cfg.get("use_sliding_window", False) and layer_idx >= int(cfg.get("max_window_layers", 0)):
            return window
    return 0


class DecoderLayer(nn.Module):
    activation = ("hidden_act", SUPPORTED_ACTIVATIONS, "silu")     # check_config's

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
        self.fusable = isinstance(self.mlp, MLP)     # forward_fused covers the dense SwiGLU layer
        self.loopable = self.fusable                 # and so does the decode loop
        window = sliding_window(cfg, layer_idx)
        if window:       # the attention kernels take the window; the fused layer and the loop do not
            self.self_attn.attn.window = window
            self.fusable = self.loopable = False

    @property
    def ffn_norm(self) -> RMSNorm:
        """The norm before the MLP (Llama's post_attention_layernorm)."""
        return self.post_attention_layernorm

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttnMetadata | None) -> torch.Tensor:
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), rope, meta)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))

    def forward_fused(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                      meta: AttnMetadata) -> torch.Tensor:
        """The same layer as one C++ call (CPU, few rows read straight from the paged cache:
        see LlamaForCausalLM.forward for when it applies). cos_sin: [T, rotary_dim] each."""
        a, g = self.self_attn, meta.groups[0]
        args = (cos_sin[0], cos_sin[1], a.attn.k_cache, a.attn.v_cache, meta.slot_mapping, g.block_tables,
                g.ctx_lens, g.block_size, a.num_heads, a.num_kv_heads, a.head_dim, a.attn.scale,
                self.input_layernorm.eps, a.q_norm.eps if a.qk_norm else 0.0)
        if a.split:           # a tensor-parallel shard: one all-reduce after attention, one after the MLP
            k, w = cpu_kernels(), self._fused_weights()
            x = x + tp.all_reduce(k.attention_partial(x, w, *args))
            return x + tp.all_reduce(k.mlp_partial(x, w, self.post_attention_layernorm.eps))
        return cpu_kernels().decode_layer(x, self._fused_weights(), *args)

    def _fused_weights(self) -> list[torch.Tensor]:
        """The tensors decode_layer reads, cached while every parameter is the same object at
        the same version (an in-place update or a replaced parameter rebuilds the list)."""
        cached = self.__dict__.get("_fused_cache")
        if cached is not None and all(mod._parameters[name] is p and p._version == v
                                      for mod, name, p, v in cached[1]):
            return cached[0]
        a, m = self.self_attn, self.mlp
        w = [self.input_layernorm.weight, kernel_weight(a.qkv_proj), kernel_bias(a.qkv_proj),
             a.q_norm.weight if a.qk_norm else _EMPTY, a.k_norm.weight if a.qk_norm else _EMPTY,
             kernel_weight(a.o_proj), kernel_bias(a.o_proj), self.ffn_norm.weight,
             kernel_weight(m.gate_up_proj), kernel_bias(m.gate_up_proj),
             kernel_weight(m.down_proj), kernel_bias(m.down_proj),
             a.qkv_proj.weight, a.o_proj.weight, m.gate_up_proj.weight, m.down_proj.weight]
        panels = [kernel_panels(x) for x in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)]
        if any(p is not None for p in panels):       # medium-row steps: the packed-panel kernel
            w += [p if p is not None else _EMPTY for p in panels]
        mods = [self.input_layernorm, a.qkv_proj, a.o_proj, self.ffn_norm,
                m.gate_up_proj, m.down_proj] + ([a.q_norm, a.k_norm] if a.qk_norm else [])
        watch = [(mod, name, p, p._version) for mod in mods for name, p in mod._parameters.items()
                 if p is not None]
        self.__dict__["_fused_cache"] = (w, watch)
        return w


_EMPTY = torch.empty(0)
# LEAPFROG_FUSED_LAYERS=0 keeps the layer-by-layer path (comparisons, debugging).
_FUSED_LAYERS = os.environ.get("LEAPFROG_FUSED_LAYERS", "1") != "0"
# LEAPFROG_DECODE_LOOP=0 also keeps forwards of query rows layer by layer (see engine/decode_loop.py).
_FORWARD_LOOP = os.environ.get("LEAPFROG_DECODE_LOOP", "1") != "0"


def fused_rows(x: torch.Tensor, meta: AttnMetadata | None) -> bool:
    """Whether a forward's layers can run as one C++ call each: float32 CPU inference whose
    attention is a single group read straight from the paged cache, rows in order (decode
    and verification batches, diffusion steps; up to 32 rows the projections use the few-row
    kernel, beyond it BLAS)."""
    if not _FUSED_LAYERS or meta is None or x.dim() != 2 or len(meta.groups) != 1:
        return False
    g = meta.groups[0]
    return (g.ctx_lens is not None and g.out_rows is None and g.row_start == 0
            and g.ctx_lens.shape[0] == x.shape[0] and cpu_inference(x, x) and cpu_kernels() is not None)


class PipelineGap(nn.Module):
    """Where a decoder layer of another pipeline stage would be: no weights, never called."""




def check_config(cfg: dict, activation: tuple[str, tuple[str, ...], str] = ("hidden_act", SUPPORTED_ACTIVATIONS, "silu")
                 ) -> None:
    """Refuse config.json values this decoder would misread or fail on only in a request: an
    activation it does not compute (the weights would load and the text would be wrong), a
    non-numeric or non-positive size, norm epsilon or context length, a flag that is not a JSON
    boolean. ValueError naming the key. `activation`: (the key naming the MLP's activation, the
    names it computes, the default)."""
    key, names, default = activation
    act = cfg.get(key) or default
    if act not in names:
        raise ValueError(f"{key} {act!r} is not supported (the MLP computes {names[0]}: "
                         f"{' or '.join(map(repr, names))})")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings"):
        value = cfg.get(key)
        if value is None and key not in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, not {value!r}")
    for key in ("tie_word_embeddings", "attention_bias", "qkv_bias", "use_qkv_bias", "mlp_bias", "use_qk_norm"):
        # a string "false" would read as true: a tied head ignoring the checkpoint's own lm_head
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise ValueError(f"{key} must be true or false, not {cfg[key]!r}")
    eps = cfg.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(f"rms_norm_eps must be a number between 0 and 1, not {eps!r}")


class DecoderModel(nn.Module):
    """Under pipeline parallelism the layers of this stage only (the others are PipelineGap,
    so that weight names keep their layer numbers); every stage keeps the embedding, the final
    norm and the LM head, which a drafter running on every rank uses."""

    def __init__(self, cfg: dict, flavour: str, layer_class: type[nn.Module] | None = None) -> None:
        super().__init__()
        layer_class = layer_class or DecoderLayer
        check_config(cfg, layer_class.activation)
        # under tensor parallelism, this rank's rows of the vocabulary (Megatron's vocab-parallel
        # embedding: other ranks' tokens embed as zeros here, and the all-reduce sums them in)
        self.vocab_start, local_vocab = tp.shard(cfg["vocab_size"], "vocab_size")
        self.embed_tokens = nn.Embedding(local_vocab, cfg["hidden_size"])
        if tp.tp_size() > 1:
            self.embed_tokens.weight.weight_loader = tp.rows_loader
        n = cfg["num_hidden_layers"]
        self.stage = tp.stage_layers(n)
        self.layers = nn.ModuleList(layer_class(cfg, flavour, i) if i in self.stage else PipelineGap()
                                    for i in range(n))
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
    # (bos id, anchor id) when the checkpoint was trained with coupled positions (its
    # leapfrog.json): rotary positions restart after the first anchor of a sequence.
    coupled_anchor: tuple[int, int] | None = None
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "0"), "up_proj": ("gate_up_proj", "1"),
    }

    layer_class: type[nn.Module] | None = None      # None: DecoderLayer

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, self.flavour, self.layer_class)
        self.lm_head = Linear(cfg["hidden_size"], self.model.embed_tokens.num_embeddings,
                              parallel="column" if tp.tp_size() > 1 else None)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # A two-stream block-diffusion model: the layers its mask tokens run (models/mask_stream.py).
        self.mask_stream = (mask_stream.MaskStream(cfg, lambda i: DecoderLayer(cfg, self.flavour, i))
                            if mask_stream.has_mask_stream(cfg) else None)

    @property
    def attention_layers(self) -> list[Attention]:
        """This stage's (under pipeline parallelism; else every layer's)."""
        return [self.model.layers[i].self_attn.attn for i in self.model.stage]

    def elsewhere(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to a layer of another pipeline stage."""
        if not name.startswith("model.layers."):
            return False
        return int(name.split(".")[2]) not in self.model.stage

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttnMetadata | None = None, capture_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final normed hidden states and the outputs of `capture_layers`
        (layer indices; drafters condition on them). Under pipeline parallelism every stage
        makes the call: each runs its layers on the rows the previous one sent, the captured
        rows reach every rank, and the hidden states are the last stage's (elsewhere zeros of
        their shape: compute_logits brings every rank the last stage's logits)."""
        if tp.pp_size() > 1:
            hidden, local, send = self.stage_forward(input_ids, positions, meta, capture_layers)
            if send is not None:
                send.wait()
            return self.finish_stage(hidden, [local], [input_ids.shape], capture_layers)
        x = self.embed(input_ids)
        if self.mask_stream is not None and meta is not None and meta.mask_token is not None:
            is_mask = input_ids.reshape(-1) == meta.mask_token
            if bool(is_mask.any()):
                if capture_layers:
                    raise ValueError("a two-stream diffusion forward captures no layers")
                return mask_stream.forward(self, x, positions, meta, is_mask, fused_rows(x, meta)), []
        rope = self.rope(positions, x.dtype)
        # Submodules are called through .forward: leapfrog registers no hooks, and
        # Module.__call__'s bookkeeping is a visible share of a small model's decode step.
        fused = fused_rows(x, meta)
        if fused and _FORWARD_LOOP:
            # The whole forward as one C++ call (decode_loop.cpp's DecodeLoop.forward), the
            # same arithmetic as the layer-by-layer fused path in one parallel region.
            g = meta.groups[0]
            loop = self.decode_loop(g.block_size)
            if loop is not None and loop.forward_supports(x.shape[0]):
                taps = sorted({i for i in capture_layers if 0 <= i < len(self.model.layers)})
                hidden, cap = loop.forward(input_ids.reshape(-1), positions.reshape(-1), meta.slot_mapping,
                                           g.block_tables, g.ctx_lens, taps,
                                           NO_FLAG if meta.interrupt is None else meta.interrupt)
                if hidden.shape[0] != x.shape[0]:
                    raise StepInterrupted
                return hidden, [cap[:, c] for c in range(len(taps))]
        x, captured = self._layers(x, rope, meta, range(len(self.model.layers)), capture_layers, fused)
        return self.model.norm.forward(x), list(captured.values())

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The rotary rows of a forward's positions, which every layer is given."""
        return Rope(self.model.rotary_emb, positions, dtype)

    def _layers(self, x: torch.Tensor, rope: Rope, meta: AttnMetadata | None, layer_ids: range,
                capture_layers: tuple[int, ...], fused: bool) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Layers `layer_ids` in order (each as one C++ call where `fused`), and the outputs of
        those of them in `capture_layers`, by layer."""
        if fused:
            t = x.shape[0]
            cos_sin = (rope.cos_sin[0].reshape(t, -1), rope.cos_sin[1].reshape(t, -1))
        captured = {}
        for i in layer_ids:
            if meta is not None and meta.interrupted():
                raise StepInterrupted
            layer = self.model.layers[i]
            x = layer.forward_fused(x, cos_sin, meta) if fused and layer.fusable else layer.forward(x, rope, meta)
            if i in capture_layers:
                captured[i] = x
        return x, captured

    def stage_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata | None,
                      capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor | None, dict, object]:
        """This pipeline stage's part of a forward: the rows the previous stage sent (the first
        stage: the embedding), this stage's layers, the result sent on to the next stage without
        waiting. Returns (the final normed hidden states on the last stage, else None; this
        stage's captured rows by layer; the send's handle or None)."""
        shape = (*input_ids.shape, self.config["hidden_size"])
        dtype = self.model.embed_tokens.weight.dtype
        x = self.embed(input_ids) if tp.is_first_stage() else tp.recv_prev(shape, dtype, input_ids.device)
        rope = self.rope(positions, x.dtype)
        x, captured = self._layers(x, rope, meta, self.model.stage, capture_layers, fused_rows(x, meta))
        if tp.is_last_stage():
            return self.model.norm.forward(x), captured, None
        return None, captured, tp.send_next(x)

    def finish_stage(self, hidden: torch.Tensor | None, captured: list[dict], shapes: list[tuple],
                     capture_layers: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """After every micro-batch's stage_forward: the captured rows of each layer, concatenated
        over the micro-batches (`captured`, `shapes`: their input shapes), from the stage that
        holds the layer to every rank; the hidden states (zeros off the last stage)."""
        size, n = self.config["hidden_size"], len(self.model.layers)
        w = self.model.embed_tokens.weight
        lead = tuple(shapes[0]) if len(shapes) == 1 else (sum(torch.Size(sh).numel() for sh in shapes),)
        rows = []
        for i in sorted({i for i in capture_layers if 0 <= i < n}):       # layer order, as without stages
            stage = next(s for s in range(tp.pp_size()) if i in tp.stage_layers(n, s))
            x = (torch.cat([c[i] for c in captured]).contiguous() if stage == tp.pp_rank()
                 else torch.empty(*lead, size, dtype=w.dtype, device=w.device))
            rows.append(tp.broadcast_from_stage(x, stage))
        if hidden is None:
            hidden = torch.zeros(*lead, size, dtype=w.dtype, device=w.device)
        return hidden, rows

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight
        if tp.tp_size() == 1:
            panels = embedding_panels(self.model.embed_tokens)
            if panels is not None:           # a GGUF table kept in its blocks (layers/quant.py)
                return cpu_kernels().panel_rows_gather(panels, input_ids).view(*input_ids.shape, -1)
            return F.embedding(input_ids, w)
        local = input_ids - self.model.vocab_start
        outside = (local < 0) | (local >= w.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), w).masked_fill_(outside.unsqueeze(-1), 0)
        return tp.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Under pipeline parallelism every rank gets the last stage's logits."""
        if tp.pp_size() == 1:
            return tp.all_gather_last(self.lm_head.forward(hidden).float())
        if tp.is_last_stage():
            logits = tp.all_gather_last(self.lm_head.forward(hidden).float()).contiguous()
        else:
            logits = torch.empty(*hidden.shape[:-1], self.config["vocab_size"], dtype=torch.float32,
                                 device=hidden.device)
        return tp.broadcast_from_stage(logits, tp.pp_size() - 1)

    def decode_loop(self, block_size: int):
        """The C++ multi-step decode loop (csrc/decode_loop.cpp) over this model's weights and
        KV caches, or None where it does not apply: not float32 inference on a CPU with the
        kernels, a layer that is not the dense SwiGLU layer, a head size that is not a multiple
        of 8, KV caches not yet allocated or neither float32 nor float16. Rebuilt when a weight
        or a cache is replaced or modified in place, as the fused layers' weight lists are."""
        if tp.world_size() > 1:          # the loop runs every layer of a whole model in one call
            return None
        # Asked at every step: the cached loop is checked first, against the attention modules
        # listed once (reaching submodules through nn.Module attributes costs more than a step's
        # Python otherwise).
        attn = self.__dict__.get("_attn_modules")
        if attn is None:
            attn = self.__dict__["_attn_modules"] = [layer.self_attn.attn for layer in self.model.layers]
        key = (block_size, skinny_rows_max(), *(id(t) for x in attn for t in (x.k_cache, x.v_cache)))
        cached = self.__dict__.get("_decode_loop")
        if cached is not None and cached[0] == key and [p._version for p in cached[3]] == cached[4] and all(
                d[name] is p for (d, name), p in zip(cached[2], cached[3])):
            return cached[1]
        layers = self.model.layers
        embed = self.model.embed_tokens.weight
        if (not _FUSED_LAYERS or cpu_kernels() is None or embed.device.type != "cpu"
                or embed.dtype != torch.float32 or not all(layer.loopable for layer in layers)
                or attn[0].head_dim % 8 or attn[0].k_cache is None
                or attn[0].k_cache.dtype not in (torch.float32, torch.float16)):
            return None
        weights = [layer._fused_weights() for layer in layers]
        lm_w, lm_panels = kernel_weight(self.lm_head), kernel_panels(self.lm_head)
        proj = {w[i].dtype for w in weights for i in (1, 5, 8, 10)}
        if len(proj) != 1 or proj.pop() not in (torch.float32, torch.float16):
            return None
        a = layers[0].self_attn
        rope = self.model.rotary_emb
        loop = cpu_kernels().DecodeLoop(
            weights, [x.k_cache for x in attn], [x.v_cache for x in attn], embed.detach(),
            self.model.norm.weight.detach(), lm_w.detach(), kernel_bias(self.lm_head),
            lm_panels if lm_panels is not None else _EMPTY, rope.cos, rope.sin, a.num_heads,
            a.num_kv_heads, a.head_dim, block_size,
            a.attn.scale, layers[0].input_layernorm.eps, a.q_norm.eps if a.qk_norm else 0.0,
            self.model.norm.eps, skinny_rows_max())
        self.configure_loop(loop)
        watch = [(mod._parameters, name, p) for mod in self.modules()
                 for name, p in mod._parameters.items() if p is not None]
        params = [p for _, _, p in watch]
        self.__dict__["_decode_loop"] = (key, loop, [(d, name) for d, name, _ in watch], params,
                                         [p._version for p in params])
        return loop

    def configure_loop(self, loop) -> None:
        """What the decode loop needs beyond the layers' weights: the anchor token of a model
        trained with coupled positions, the embedding's quantized panels."""
        if self.coupled_anchor is not None:    # run() takes each row's anchor index
            loop.set_anchor_token(self.coupled_anchor[1])
        embed_panels = embedding_panels(self.model.embed_tokens)
        if embed_panels is not None:
            loop.set_embed_panels(embed_panels)

    # --- positions: the model's own contract (coupled positions, `couplets`) --------------
    def rotary_positions(self, seq, start: int, n: int) -> list[int] | range:
        """Rotary positions of tokens start..start+n-1 of `seq`: their indices, except in a model
        trained with coupled positions, where past the first anchor token they count from it
        (its cache slots do not)."""
        if self.coupled_anchor is None:
            return range(start, start + n)
        a = first_anchor(seq, self.coupled_anchor[1], start + n)
        return [p - a if 0 <= a < p else p for p in range(start, start + n)]

    def loop_anchors(self, seqs: list) -> list[int] | None:
        """Each row's first anchor index for the decode loop (None: the model has no anchors)."""
        if self.coupled_anchor is None:
            return None
        return [first_anchor(s, self.coupled_anchor[1], len(s.token_ids)) for s in seqs]

    def prompt_ids(self, ids: list[int]) -> list[int]:
        """A prompt as the model takes it. With coupled positions one that ends in two or more
        anchor tokens ends in one: positions restart after the first, so a second (a client that
        appends the marker, which the tokenizer appends too) would shift every answer token."""
        n = len(ids)
        while self.coupled_anchor is not None and n >= 2 and ids[n - 1] == ids[n - 2] == self.coupled_anchor[1]:
            n -= 1
        return ids[:n]

    @torch.inference_mode()
    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] -> logits [B, T, V]: plain causal forward without a cache (tests, eval)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        if self.coupled_anchor is not None:
            positions = coupled_positions(input_ids, *self.coupled_anchor)
        hidden, _ = self.forward(input_ids, positions, None)
        return self.compute_logits(hidden)


class Qwen2ForCausalLM(LlamaForCausalLM):
    flavour = "qwen2"


class Qwen3ForCausalLM(LlamaForCausalLM):
    flavour = "qwen3"


def first_anchor(seq, anchor_id: int, known: int) -> int:
    """For a model trained with coupled positions: the index of `seq`'s first anchor token among
    its first `known` tokens, -1 while there is none (it may yet be generated). Kept in
    `seq.rotary_anchor` once found."""
    if seq.rotary_anchor is None or seq.rotary_anchor < 0:
        head = seq.token_ids[:known]
        seq.rotary_anchor = head.index(anchor_id) if anchor_id in head else -1
    return seq.rotary_anchor
