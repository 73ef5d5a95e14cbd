"""RMSNorm (Zhang & Sennrich 2019), computed in fp32 like the reference implementations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leapfrog.layers.cpu_kernels import cpu_inference, cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.shape[-1] == self.weight.shape[0]:
            mod = cpu_kernels() if cpu_inference(x, self.weight) else None
            if mod is not None:            # one kernel where torch's CPU rms_norm runs several
                return mod.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)   # one fused op
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
