"""Tensor parallelism's process group and its collectives, on torch.distributed (gloo on CPUs,
NCCL on GPUs). Every layer asks `tp_size()` / `tp_rank()` when it is built, so a model built
after `init` holds only its rank's shard: attention heads and the KV cache, MLP columns and
rows, vocabulary rows of the embedding and the LM head (Megatron-LM's column- and row-parallel
split, Shoeybi et al. 2019). One all-reduce follows each attention block and each MLP, one
more the embedding; the logits are gathered.

Outside `init` the size is 1 and every collective is the identity.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class _State:
    size: int = 1
    rank: int = 0
    objects: Any = None          # a gloo group for Python objects (NCCL cannot carry them)


_STATE = _State()


def tp_size() -> int:
    return _STATE.size


def tp_rank() -> int:
    return _STATE.rank


def init(rank: int, size: int, init_method: str | None = None, backend: str | None = None,
         timeout_s: float = 300.0) -> None:
    """Join the tensor-parallel group: `init_method` tcp://host:port (None: torchrun's env://)."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    _STATE.size, _STATE.rank = size, rank
    _STATE.objects = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD


def free_port() -> int:
    """A TCP port free on loopback now (the group's rendezvous, a server a benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE.size, _STATE.rank, _STATE.objects = 1, 0, None


def shard(n: int, what: str) -> tuple[int, int]:
    """(start, length) of this rank's equal share of `n` rows."""
    size = _STATE.size
    if n % size:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={size}")
    local = n // size
    return _STATE.rank * local, local


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks, in place."""
    if _STATE.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """The ranks' tensors side by side along the last dimension (rank order)."""
    if _STATE.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_STATE.objects)
    return box[0]


# --- weight loaders: each rank keeps its rows (column parallel) or columns (row parallel) ------
def rows_loader(param: torch.nn.Parameter, tensor: torch.Tensor, shard_id: object = None) -> None:
    """A column-parallel weight (or bias, or vocabulary table): this rank's rows."""
    start, local = _STATE.rank * param.shape[0], param.shape[0]
    if tensor.shape[0] != local * _STATE.size or tensor.shape[1:] != param.shape[1:]:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} x {_STATE.size} ranks vs checkpoint "
                         f"{tuple(tensor.shape)}")
    param.data.copy_(tensor.narrow(0, start, local))


def columns_loader(param: torch.nn.Parameter, tensor: torch.Tensor, shard_id: object = None) -> None:
    """A row-parallel weight: this rank's input columns. Its bias is added once, on rank 0."""
    if param.dim() == 1:
        if param.shape != tensor.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(tensor.shape)}")
        param.data.copy_(tensor if _STATE.rank == 0 else torch.zeros_like(tensor))
        return
    local = param.shape[1]
    if tensor.shape[1] != local * _STATE.size or tensor.shape[0] != param.shape[0]:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} x {_STATE.size} ranks vs checkpoint "
                         f"{tuple(tensor.shape)}")
    param.data.copy_(tensor.narrow(1, _STATE.rank * local, local))
