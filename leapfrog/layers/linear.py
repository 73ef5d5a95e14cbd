"""Linear layers that load their own weights.

Each parameter carries a `weight_loader(param, tensor, shard_id)`, so the checkpoint loader
never needs to know that q/k/v (or gate/up) are stored packed in one matrix here: one matmul
instead of three is what keeps small-batch decoding fast on a CPU.
"""
from __future__ import annotations

import torch
from torch import nn

from leapfrog.layers.cpu_kernels import cpu_inference, cpu_kernels


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard_id: object = None) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(tensor.shape)}")
    param.data.copy_(tensor)


def skinny_rows_max() -> int:
    """Largest row count sent to the CPU skinny-matmul kernel, which reads each weight row once
    where the BLAS kernel re-streams the weights for every few rows and splits small products
    poorly across threads (docs/benchmarks.md has the timings)."""
    return 32 if torch.get_num_threads() > 1 else 16


# Row counts up to this go to the packed-panel kernel when the layer has panels
# (compact_cpu_weights); larger products (prefill) go to BLAS.
PANEL_ROWS_MAX = 256
# Layers whose packed copy would be bigger than this get none (and keep the row-major few-row
# kernel): 2 bytes per weight for a float16-exact weight, 4 otherwise.
PANEL_MAX_BYTES = 1 << 28


def linear_forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """F.linear, except float32 inference on a CPU at decode-like row counts, which goes to the
    C++ kernels (layers/cpu_kernels.py): up to PANEL_ROWS_MAX rows (decode, draft verification,
    a batch's step) to the packed-panel kernel, which sums every output the same way whatever
    the row count; without panels, few rows to the row-major skinny kernel. Quantized panels
    (a GGUF weight's blocks, layers/quant.py) serve every row count: no float32 weight is kept."""
    w = layer.weight
    rows = x.numel() // max(1, x.shape[-1])
    quantized = bool(layer.__dict__.get("_quant_panels"))
    if (rows <= PANEL_ROWS_MAX or quantized) and cpu_inference(x, w):
        mod = cpu_kernels()
        if mod is not None:
            b = layer.bias if layer.bias is not None else _EMPTY
            panels = kernel_panels(layer)
            if panels is not None:
                y = mod.panel_linear(x.reshape(-1, x.shape[-1]), panels, b, w.shape[0])
                return y.view(*x.shape[:-1], w.shape[0])
            if rows <= skinny_rows_max():
                w = kernel_weight(layer)
                return mod.skinny_linear(x.reshape(-1, x.shape[-1]), w, b).view(*x.shape[:-1], w.shape[0])
    return torch.nn.functional.linear(x, w, layer.bias)


def kernel_panels(layer: nn.Linear) -> torch.Tensor | None:
    """The weight packed in column panels for the medium-row kernel, while it is current."""
    w = layer.weight
    panels = layer.__dict__.get("_panels")
    if panels is not None and panels[1] is w and panels[2] == w._version:
        return panels[0]
    return None


def kernel_weight(layer: nn.Linear) -> torch.Tensor:
    """The weight the CPU few-row kernel reads: the exact float16 copy while it is current
    (compact_cpu_weights), else the weight itself."""
    w = layer.weight
    half = layer.__dict__.get("_half_weight")
    if half is not None and half[1] is w and half[2] == w._version:
        return half[0]               # exact float16 copy: half the bytes to stream per step
    return w


def kernel_bias(layer: nn.Linear) -> torch.Tensor:
    return layer.bias if layer.bias is not None else _EMPTY


def int8_products_available() -> bool:
    """Whether int8 products over quantized panels run at speed here (AVX512-VNNI or AVX2)."""
    mod = cpu_kernels()
    return mod is not None and bool(mod.int8_dot_available())


def products_available(precision: str) -> str | None:
    """None when `precision` (matmul_precision) runs at speed on this CPU, else the instruction
    set it lacks (the products would run as scalar loops: callers fall back to float32)."""
    needs = {"bfloat16": (bf16_products_available, "AVX512-BF16"), "int8": (int8_products_available, "AVX2")}
    check, isa = needs.get(precision, (lambda: True, ""))
    return None if check() else isa


def bf16_products_available() -> bool:
    """Whether bfloat16 panel products run on AVX512-BF16 here: the C++ kernels are built (for
    this CPU) and it has the instruction. Elsewhere they would run as a scalar loop."""
    mod = cpu_kernels()
    return mod is not None and bool(mod.bf16_dot_available())


def compact_cpu_weights(model: nn.Module, precision: str = "float32") -> int:
    """Prepare every float32 CPU linear for the C++ few-row kernels; returns the float16 copies made.

    A weight exactly representable in float16 gets a float16 copy, widened exactly while it streams
    (half the bytes, the same results); one up to PANEL_MAX_BYTES is also packed in column panels,
    so every product of up to PANEL_ROWS_MAX rows has a one-row step's bits. precision="bfloat16"
    packs bfloat16 panels instead, with no float16 copy. A copy is ignored once its weight changes.
    (docs/decisions.md, "CPU performance")"""
    if precision not in ("float32", "bfloat16", "int8"):
        raise ValueError(f"matmul precision {precision!r}: expected float32, bfloat16 or int8")
    n = 0
    mod = cpu_kernels()
    head = getattr(model, "lm_head", None)
    head_requantized = False
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or not isinstance(w, torch.Tensor):
            continue
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2:
            continue
        if precision == "int8" and module.__dict__.pop("_requantize", False) and mod is not None:
            # a GGUF weight in blocks the panels cannot hold (Q6_K, Q2_K, Q3_K, the i-quants below IQ4,
            # or shards the panels cannot stack): 8-bit panels quantized
            # again from it, and its float32 weight gives way to a placeholder (the head keeps
            # its: it may be the embedding), as layers/quant.py attach_quant_panels does
            # deferred: layers.quant loads only for GGUF weights
            from leapfrog.layers.quant import int8_layout, requantized_panels
            panels = int8_layout(requantized_panels(w))
            if module is not head:
                module.weight = nn.Parameter(torch.zeros(1, dtype=w.dtype).expand(w.shape), requires_grad=False)
                w = module.weight
            module._panels = (panels, w, w._version)
            module._quant_panels = True
            head_requantized |= module is head
            continue
        panels = kernel_panels(module) if module.__dict__.get("_quant_panels") else None
        if panels is not None:       # a GGUF weight's quantized panels (layers/quant.py) stay, relaid for int8
            if precision == "int8" and panels.dtype == torch.uint8:
                # deferred: layers.quant loads only for int8 GGUF panels
                from leapfrog.layers.quant import int8_layout
                module._panels = (int8_layout(panels), w, w._version)
            continue
        if precision == "bfloat16" and mod is not None and w.numel() * 2 <= PANEL_MAX_BYTES:
            # every product up to PANEL_ROWS_MAX rows reads the panels: no float16 copy
            module._panels = (mod.pack_panels(w.detach(), bf16=True), w, w._version)
            continue
        half = w.detach().to(torch.float16)
        exact = torch.equal(half.to(torch.float32), w.detach())
        if exact:
            module._half_weight = (half.contiguous(), w, w._version)
            n += 1
        source = half if exact else w.detach()
        if mod is not None and source.numel() * source.element_size() <= PANEL_MAX_BYTES:
            module._panels = (mod.pack_panels(source), w, w._version)
    if head_requantized:         # a tied embedding reads its rows from the head's new panels
        from leapfrog.layers.quant import read_embedding_from_head
        read_embedding_from_head(model)
    return n


_EMPTY = torch.empty(0)


class Linear(nn.Linear):
    """`parallel`: None (whole), "column" (this tensor-parallel rank's output rows) or "row" (its
    input columns; the caller all-reduces the output). The sizes given are the rank's own."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, parallel: str | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        # deferred: layers.parallel loads only when a layer is built
        from leapfrog.layers import parallel as tp
        loader = {None: default_weight_loader, "column": tp.rows_loader, "row": tp.columns_loader}[parallel]
        for p in self.parameters():
            p.weight_loader = loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_forward(self, x)


class PackedLinear(nn.Linear):
    """Several linears with the same input, stored row-stacked: shards named by shard_id."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False,
                 column_parallel: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.column_parallel = column_parallel     # sizes are a tensor-parallel rank's: it loads its rows
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.offsets[name] = (start, size)
            start += size
        for p in self.parameters():
            p.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:      # stored already packed in our order (LLaDA2's query_key_value)
            if self.column_parallel:
                raise ValueError("a matrix stored packed cannot be split across tensor-parallel ranks")
            return default_weight_loader(param, tensor)
        start, size = self.offsets[str(shard_id)]
        target = param.data.narrow(0, start, size)
        if self.column_parallel:
            # deferred: layers.parallel loads only when a column-parallel shard loads
            from leapfrog.layers.parallel import tp_rank, tp_size
            if tensor.shape[0] != size * tp_size():
                raise ValueError(f"shape mismatch for shard {shard_id}: parameter {tuple(target.shape)} x "
                                 f"{tp_size()} ranks vs checkpoint {tuple(tensor.shape)}")
            tensor = tensor.narrow(0, tp_rank() * size, size)
        if target.shape != tensor.shape:
            raise ValueError(f"shape mismatch for shard {shard_id}: parameter "
                             f"{tuple(target.shape)} vs checkpoint {tuple(tensor.shape)}")
        target.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_forward(self, x)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split([size for _, size in self.offsets.values()], dim=-1))


def embedding_panels(emb: nn.Module) -> torch.Tensor | None:
    """The quantized panels `emb`'s rows are read from (layers/quant.py's attach_embedding_panels),
    or None when it keeps its float table."""
    own = emb.__dict__.get("_own_panels")
    if own is not None:
        return own
    head = emb.__dict__.get("_tied_head")
    if head is None:
        return None
    return kernel_panels(head)
