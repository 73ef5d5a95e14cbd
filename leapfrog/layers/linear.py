"""Linear layers that load their own weights.

Each parameter carries a `weight_loader(param, tensor, shard_id)`, so the checkpoint loader
never needs to know that q/k/v (or gate/up) are stored packed in one matrix here: one matmul
instead of three is what keeps small-batch decoding fast on a CPU.
"""
from __future__ import annotations

import torch
from torch import nn


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard_id: object = None) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(tensor.shape)}")
    param.data.copy_(tensor)


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        for p in self.parameters():
            p.weight_loader = default_weight_loader


class PackedLinear(nn.Linear):
    """Several linears with the same input, stored row-stacked: shards named by shard_id."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.offsets[name] = (start, size)
            start += size
        for p in self.parameters():
            p.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:      # stored already packed in our order (LLaDA2's query_key_value)
            return default_weight_loader(param, tensor)
        start, size = self.offsets[str(shard_id)]
        target = param.data.narrow(0, start, size)
        if target.shape != tensor.shape:
            raise ValueError(f"shape mismatch for shard {shard_id}: parameter "
                             f"{tuple(target.shape)} vs checkpoint {tuple(tensor.shape)}")
        target.copy_(tensor)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split([size for _, size in self.offsets.values()], dim=-1))
