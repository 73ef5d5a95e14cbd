"""The training steps' precision: one switch (`--dtype`) shared by every training loop."""
from __future__ import annotations

import torch

TRAIN_DTYPES = ("fp32", "bf16")


def autocast(dtype: str) -> torch.autocast:
    """The autocast context of a training step: bfloat16 products with float32 master weights for
    "bf16" (pays on a CPU with AVX512-BF16 or AMX; emulated and slow without), nothing for "fp32"."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
