"""Optional C++ kernels for CPU inference (paged decode attention, few-row matmul, RMSNorm), compiled on first use with torch's extension
builder (gcc). Anything that fails to build simply leaves the portable SDPA path in charge.
Set LEAPFROG_CPU_KERNELS=0 to disable them."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

_module = None
_tried = False


def cpu_inference(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when a float32 CPU op needs no autograd: the C++ kernels may run it."""
    return (x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def paged_attention_module():
    """The compiled module, or None when unavailable (no compiler, disabled, build error)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("LEAPFROG_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load
        src = Path(__file__).resolve().parent.parent / "csrc" / "paged_attention_cpu.cpp"
        _module = load(name="leapfrog_paged_attention_cpu", sources=[str(src)],
                       extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                       verbose=False)
    except Exception as e:  # no compiler, headers missing, ...: fall back to SDPA
        print(f"[leapfrog] CPU attention kernel unavailable, using SDPA ({type(e).__name__}: {e})",
              file=sys.stderr)
        _module = None
    return _module
