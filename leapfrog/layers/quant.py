"""GGUF weights kept quantized on a CPU: packed panels the C++ kernels read in their blocks.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

QBLOCK = 32
PANEL = 16
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
# K-quants: super-blocks of 256 weights, eight sub-blocks of 32 with 6-bit scales and minimums
K_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176}
# 4-bit indices into a fixed grid of 16 int8 values: per 32 weights (IQ4_NL), or super-blocks of
# 256 with 6-bit sub-block scales (IQ4_XS); held in bytes, the grid value itself
IQ4_BLOCK_BYTES = {"IQ4_NL": 18, "IQ4_XS": 136}
IQ4_GRID = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int16)
QUANT_TYPES = (*BLOCK_BYTES, *K_BLOCK_BYTES, *IQ4_BLOCK_BYTES)
BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 8, "Q5_1": 8, "Q8_0": 8, "Q4_K": 4, "Q5_K": 8, "IQ4_NL": 8, "IQ4_XS": 8}


class InexactScales(ValueError):
    """K-quant sub-block scales that float16 (the panels' scale type) holds only as subnormals or
    not at all: such a weight keeps the dequantized path."""


def unpack_blocks(kind: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF blocks [N, row bytes] -> (q [N, K] uint8, d [N, K/32] float16, m [N, K/32] float16)
    with every weight = d * q + m. For the K-quants d and m are a sub-block's scale and minimum
    (the super-block's float16 factor times the 6-bit integer) rounded to float16; InexactScales
    when that rounding would lose more than float16's own precision."""
    if kind in K_BLOCK_BYTES:
        return unpack_k_blocks(kind, raw)
    if kind in IQ4_BLOCK_BYTES:
        return unpack_iq4_blocks(kind, raw)
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, BLOCK_BYTES[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "Q8_0":
        q = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q.reshape(n, -1), d, (np.float16(-128) * d).astype(np.float16)
    if kind in ("Q4_1", "Q5_1"):
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        rest = blocks[..., 4:]
    else:
        m = None
        rest = blocks[..., 2:]
    if kind in ("Q5_0", "Q5_1"):
        qh = rest[..., 0:4].copy().view(np.uint32)[..., 0]
        high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        rest = rest[..., 4:]
    else:
        high = 0
    qs = rest[..., 0:16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | high          # elements 0..15, then 16..31
    offset = {"Q4_0": -8, "Q5_0": -16}.get(kind)
    if m is None:
        m = (np.float16(offset) * d).astype(np.float16)
    return q.astype(np.uint8).reshape(n, -1), d, m


def k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of a K-quant super-block's sub-block scales -> (scales [..., 8], minimums
    [..., 8]), 6-bit integers: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
    (minimums); sub-blocks 4-7 with their low 4 bits in bytes 8-11 (scale in the low nibble,
    minimum in the high one) and their top 2 bits in the top bits of bytes 0-3 and 4-7."""
    first, second, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([first & 0x3F, (low & 0x0F) | ((first >> 6) << 4)], axis=-1)
    mins = np.concatenate([second & 0x3F, (low >> 4) | ((second >> 6) << 4)], axis=-1)
    return scales, mins


def unpack_k_blocks(kind: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-blocks as 32-weight blocks (unpack_blocks). A super-block: float16 d and
    dmin, the packed scales, for Q5_K 32 bytes of fifth bits (bit j of byte l: weight l of
    sub-block j), then 128 bytes of 4-bit values, 32 bytes per pair of sub-blocks (sub-block 2i
    in the low nibbles, 2i + 1 in the high). Weight = d * scale * q - dmin * minimum."""
    n = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(n, -1, K_BLOCK_BYTES[kind])
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    scales, mins = k_scales(b[..., 4:16])
    nib = b[..., -128:].reshape(n, -1, 4, 1, 32)
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=3).reshape(n, -1, 8, 32)      # [N, S, sub-block, 32]
    if kind == "Q5_K":
        fifth = b[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        q = q | ((fifth & 1) << 4)
    sub_d = (d[..., None] * scales.astype(np.float32)).reshape(n, -1)      # exact in float32
    sub_m = (-(dmin[..., None] * mins.astype(np.float32))).reshape(n, -1)
    return q.reshape(n, -1).astype(np.uint8), _half_factors(sub_d, kind), _half_factors(sub_m, kind)


def _half_factors(exact: np.ndarray, kind: str) -> np.ndarray:
    """Sub-block factors exact in float32, rounded to the panels' float16; InexactScales where
    float16 holds one only as a subnormal (or not at all)."""
    half = exact.astype(np.float16)
    wide = half.astype(np.float32)
    normal = (wide == 0) | (np.abs(wide) >= np.finfo(np.float16).tiny)
    if not (np.all(np.isfinite(wide)) and np.all(normal[exact != 0]) and np.all((wide == 0) == (exact == 0))):
        raise InexactScales(f"{kind} sub-block scales outside float16's normal range")
    return half


def unpack_iq4_blocks(kind: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ4_NL / IQ4_XS blocks as 8-bit blocks (unpack_blocks): q = the grid value + 128, m = -128 d.
    IQ4_NL: float16 d, then 16 bytes of indices (weight j in the low nibble of byte j, weight
    16 + j in the high one). IQ4_XS: float16 d, the sub-blocks' 6-bit scales (2 high bits each in
    a 16-bit word, 4 low bits in 4 bytes, two a byte), then 16 bytes of indices per 32 weights as
    IQ4_NL's; a sub-block's factor is d * (scale - 32), rounded to float16 as the K-quants'."""
    n = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(n, -1, IQ4_BLOCK_BYTES[kind])
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "IQ4_NL":
        idx, factor = b[..., 2:18], d                                          # [N, B, 16], [N, B]
    else:
        high = b[..., 2:4].copy().view(np.uint16)[..., 0:1] >> (2 * np.arange(8, dtype=np.uint16))   # [N, S, 8]
        low = b[..., 4:8, None] >> np.array([0, 4], np.uint8)                                      # [N, S, 4, 2]
        scale = (low.reshape(n, -1, 8) & 0x0F).astype(np.int32) | ((high & 3).astype(np.int32) << 4)
        idx = b[..., 8:136].reshape(n, -1, 8, 16)
        factor = d[..., None] * (scale - 32).astype(np.float32)                                     # [N, S, 8]
    idx = idx.reshape(n, -1, 16)
    q = np.concatenate([idx & 0x0F, idx >> 4], axis=-1)                       # [N, blocks, 32]
    q = (IQ4_GRID[q] + 128).astype(np.uint8).reshape(n, -1)
    dh = _half_factors(factor.reshape(n, -1).astype(np.float32), kind)
    return q, dh, _half_factors(np.float32(-128) * dh.astype(np.float32), kind)


def pack_quant_panels(q: np.ndarray, d: np.ndarray, m: np.ndarray, bits: int) -> torch.Tensor:
    """[P, K/32, bytes per block] uint8 panels (columns padded to a multiple of 16 with zeros)."""
    n, k = q.shape
    nb, p = k // QBLOCK, -(-n // PANEL)
    pad = p * PANEL - n
    if pad:
        q = np.concatenate([q, np.zeros((pad, k), np.uint8)])
        d = np.concatenate([d, np.zeros((pad, nb), np.float16)])
        m = np.concatenate([m, np.zeros((pad, nb), np.float16)])
    dp = np.ascontiguousarray(d.reshape(p, PANEL, nb).transpose(0, 2, 1)).view(np.uint8).reshape(p, nb, 2 * PANEL)
    mp = np.ascontiguousarray(m.reshape(p, PANEL, nb).transpose(0, 2, 1)).view(np.uint8).reshape(p, nb, 2 * PANEL)
    qp = q.reshape(p, PANEL, nb, QBLOCK).transpose(0, 2, 3, 1)                  # [P, NB, 32 k, 16 columns]
    if bits == 4:
        qp = qp[..., :8] | (qp[..., 8:] << 4)
    out = np.concatenate([dp, mp, np.ascontiguousarray(qp).reshape(p, nb, -1)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out))


def requantized_panels(w: torch.Tensor) -> torch.Tensor:
    """8-bit panels of a dequantized weight [N, K] (K a multiple of 32) quantized again as Q8_0
    is: per 32 weights d = max |w| / 127 in float16, q = w / d rounded to nearest. Each weight
    moves by at most half of its block's d."""
    v = w.detach().to(torch.float32).numpy().reshape(w.shape[0], -1, QBLOCK)
    d = (np.abs(v).max(-1) / 127).astype(np.float16)
    inv = np.divide(1, d.astype(np.float32), out=np.zeros(d.shape, np.float32), where=d > 0)
    q = np.clip(np.rint(v * inv[..., None]), -127, 127).astype(np.int16) + 128
    m = (np.float16(-128) * d).astype(np.float16)
    return pack_quant_panels(q.astype(np.uint8).reshape(w.shape[0], -1), d, m, 8)


def int8_layout(panels: torch.Tensor) -> torch.Tensor:
    """Quantized panels relaid for the integer products (matmul_precision="int8", csrc/cpu_math.h):
    each block's values as 8 groups of 4 k, [16 columns][4 k] each; 4-bit values pair groups 2i
    and 2i + 1 in the low and high nibbles. Held as int8, which tells the kernels the layout."""
    p, nb, size = panels.shape
    head, body = panels[..., :64], panels[..., 64:]
    bits = 4 if size == 64 + QBLOCK * PANEL // 2 else 8
    if bits == 4:
        body = body.reshape(p, nb, QBLOCK, PANEL // 2)
        body = torch.cat([body & 0x0F, body >> 4], dim=-1)                    # [P, NB, 32 k, 16 columns]
    q = body.reshape(p, nb, 8, 4, PANEL).transpose(3, 4)                        # [P, NB, 8 groups, 16, 4 k]
    if bits == 4:
        q = q[:, :, 0::2] | (q[:, :, 1::2] << 4)
    return torch.cat([head, q.reshape(p, nb, -1)], dim=-1).contiguous().view(torch.int8)


def quant_panels(parts: list[tuple[str, np.ndarray]]) -> torch.Tensor | None:
    """The panels of a linear stored as `parts` (a packed linear's shards, in order; each (GGUF
    type, blocks [rows, row bytes])), or None when the kernels cannot read them together."""
    kinds = {kind for kind, _ in parts}
    if not kinds <= set(QUANT_TYPES):
        return None
    if len(parts) > 1 and any(raw.shape[0] % PANEL for _, raw in parts):
        return None                    # a shard's rows would share a panel with the next's
    try:
        unpacked = [unpack_blocks(kind, raw) for kind, raw in parts]
    except InexactScales:
        return None
    q, d, m = (np.concatenate([u[i] for u in unpacked]) for i in range(3))
    # shards of different types (a Q4_K_M file's q, k and v) share the widest one's panels: every
    # block is d * q + m whatever its type, and 4-bit values are 8-bit values below 16
    return pack_quant_panels(q, d, m, max(BITS[kind] for kind in kinds))


def attach_quant_panels(model: nn.Module, blocks: dict[str, tuple[str, np.ndarray]]) -> int:
    """Give each CPU linear of `model` whose weights arrived in kernel-readable GGUF blocks
    (`blocks`: checkpoint name -> (type, blocks)) its quantized panels; returns how many."""
    # deferred: cpu_kernels loads only when panels are attached
    from leapfrog.layers.cpu_kernels import cpu_kernels
    if cpu_kernels() is None:
        return 0
    packed = getattr(model, "packed_modules", {})
    done = 0
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or not isinstance(w, torch.Tensor) or w.device.type != "cpu":
            continue
        if isinstance(getattr(module, "offsets", None), dict):          # a PackedLinear: its shards in order
            by_shard = {shard: src for src, (dst, shard) in packed.items() if name.endswith(f".{dst}")}
            keys = [f"{name[:-len(dst)]}{by_shard[s]}.weight" for s in module.offsets
                    for dst in [packed[by_shard[s]][0]] if s in by_shard]
            if len(keys) != len(module.offsets):
                continue
        else:
            keys = [f"{name}.weight"]
        if name == "lm_head" and "lm_head.weight" not in blocks and getattr(model, "tie_word_embeddings", False):
            keys = ["model.embed_tokens.weight"]
        if not all(k in blocks for k in keys):
            continue
        panels = quant_panels([blocks[k] for k in keys])
        if panels is None and w.shape[1] % QBLOCK == 0:
            # blocks the panels cannot hold exactly (Q6_K's 16-weight scales, Q2_K, Q3_K, the
            # i-quants below IQ4): requantized to 8 bits per 32
            # weights if the engine multiplies in int8 (layers/linear.py compact_cpu_weights)
            module.__dict__["_requantize"] = True
        if panels is None or panels.shape[1] * QBLOCK != w.shape[1] or panels.shape[0] != -(-w.shape[0] // PANEL):
            continue              # (a tensor-parallel rank's share, for one)
        if name != "lm_head":
            # the float32 weight is read no more (every product reads the panels): a placeholder
            # of its shape takes its place, and the memory goes (the head may be the embedding)
            module.weight = nn.Parameter(torch.zeros(1, dtype=w.dtype).expand(w.shape), requires_grad=False)
            w = module.weight
        module._panels = (panels, w, w._version)
        module._quant_panels = True
        done += 1
    return done


def attach_embedding_panels(model: nn.Module, blocks: dict[str, tuple[str, np.ndarray]]) -> bool:
    """Read `model`'s token embedding from quantized panels when its GGUF blocks allow it: the
    tied LM head's panels, or panels of its own; its float32 table (and the tied head's weight)
    becomes a placeholder of its shape. Single-process CPU models only."""
    # deferred: layers.parallel and cpu_kernels load only when embedding panels are attached
    from leapfrog.layers import parallel as tp
    from leapfrog.layers.cpu_kernels import cpu_kernels
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    key = "model.embed_tokens.weight"
    if (not isinstance(emb, nn.Embedding) or key not in blocks or emb.weight.device.type != "cpu"
            or emb.weight.dtype != torch.float32 or tp.world_size() > 1 or cpu_kernels() is None):
        return False
    head = getattr(model, "lm_head", None)
    tied = head is not None and head.weight is emb.weight
    if tied and head.__dict__.get("_quant_panels"):
        return read_embedding_from_head(model)
    own = quant_panels([blocks[key]])
    if own is None or own.shape[1] * QBLOCK != emb.weight.shape[1] or own.shape[0] * PANEL < emb.weight.shape[0]:
        return False
    placeholder = nn.Parameter(torch.zeros(1, dtype=emb.weight.dtype).expand(emb.weight.shape), requires_grad=False)
    emb.weight = placeholder
    if tied:
        head.weight = placeholder
    emb.__dict__["_own_panels"] = own
    emb.__dict__["_tied_head"] = None
    return True


def read_embedding_from_head(model: nn.Module) -> bool:
    """A token embedding tied to an LM head that reads quantized panels looks its rows up in the
    head's panels, and the float32 table they share becomes a placeholder of its shape. Also
    after the engine gives a Q6_K head 8-bit panels (layers/linear.py compact_cpu_weights)."""
    # deferred: layers.parallel loads only when embedding panels are attached
    from leapfrog.layers import parallel as tp
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if (not isinstance(emb, nn.Embedding) or head is None or head.weight is not emb.weight
            or not head.__dict__.get("_quant_panels") or emb.weight.device.type != "cpu"
            or emb.weight.dtype != torch.float32 or tp.world_size() > 1):
        return False
    placeholder = nn.Parameter(torch.zeros(1, dtype=emb.weight.dtype).expand(emb.weight.shape), requires_grad=False)
    emb.weight = placeholder
    head.weight = placeholder
    head._panels = (head._panels[0], placeholder, placeholder._version)
    emb.__dict__["_own_panels"] = None
    emb.__dict__["_tied_head"] = head           # not a submodule of the embedding
    return True
