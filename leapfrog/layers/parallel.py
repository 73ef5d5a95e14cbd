"""Tensor and pipeline parallelism's process groups and collectives, on torch.distributed (gloo
on CPUs, NCCL on GPUs).

Tensor parallelism: every layer asks `tp_size()` / `tp_rank()` when it is built, so a model
built after `init` holds only its rank's shard: attention heads and the KV cache, MLP columns
and rows, vocabulary rows of the embedding and the LM head (Megatron-LM's column- and row-
parallel split, Shoeybi et al. 2019). One all-reduce follows each attention block and each MLP,
one more the embedding; the logits are gathered.

Pipeline parallelism: the decoder layers are cut into `pp_size()` contiguous stages
(`stage_layers`); a stage receives the hidden rows from the previous stage and sends its own to
the next (`send_next` / `recv_prev`, point to point between the same tensor-parallel rank of
neighbouring stages). Global rank = stage * tp_size + tensor-parallel rank.

Outside `init` both sizes are 1 and every collective is the identity.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class _State:
    size: int = 1                # tensor-parallel size
    rank: int = 0                # rank inside the tensor-parallel group
    pp_size: int = 1
    pp_rank: int = 0             # pipeline stage
    world_rank: int = 0
    group: Any = None            # this stage's tensor-parallel group (None: the whole world)
    objects: Any = None          # a gloo group for Python objects (NCCL cannot carry them)
    recv_wait: float = 0.0       # seconds spent in recv_prev


_STATE = _State()


def tp_size() -> int:
    return _STATE.size


def tp_rank() -> int:
    return _STATE.rank


def pp_size() -> int:
    return _STATE.pp_size


def pp_rank() -> int:
    return _STATE.pp_rank


def world_size() -> int:
    return _STATE.size * _STATE.pp_size


def world_rank() -> int:
    return _STATE.world_rank


def is_first_stage() -> bool:
    return _STATE.pp_rank == 0


def is_last_stage() -> bool:
    return _STATE.pp_rank == _STATE.pp_size - 1


def init(rank: int, size: int, init_method: str | None = None, backend: str | None = None,
         timeout_s: float = 300.0, pipeline_size: int = 1) -> None:
    """Join the group of `size` processes (`init_method` tcp://host:port; None: torchrun's
    env://), as `pipeline_size` stages of size // pipeline_size tensor-parallel ranks each."""
    if pipeline_size < 1 or size % pipeline_size:
        raise ValueError(f"{size} processes cannot form {pipeline_size} pipeline stages of equal size")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":                 # one GPU per rank: torchrun's local rank, else by rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    tp = size // pipeline_size
    _STATE.size, _STATE.rank = tp, rank % tp
    _STATE.pp_size, _STATE.pp_rank, _STATE.world_rank = pipeline_size, rank // tp, rank
    _STATE.group = None
    if pipeline_size > 1:
        # every rank creates every group, in the same order (torch.distributed's rule)
        for stage in range(pipeline_size):
            g = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
            if stage == _STATE.pp_rank:
                _STATE.group = g
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
    _STATE.size, _STATE.rank, _STATE.objects, _STATE.group = 1, 0, None, None
    _STATE.pp_size, _STATE.pp_rank, _STATE.world_rank = 1, 0, 0


@contextmanager
def whole() -> Iterator[None]:
    """Modules built inside are whole, not shards (a drafter, replicated on every rank: its
    layers then never call a collective)."""
    saved = _STATE.size, _STATE.rank
    _STATE.size, _STATE.rank = 1, 0
    try:
        yield
    finally:
        _STATE.size, _STATE.rank = saved


def shared_clock(reading: float) -> float:
    """Rank 0's clock `reading` on every rank (one broadcast per reading): a decision made from
    measured time (confidence-scheduled verification) is then the same on every rank, as their
    schedules must be. Alone: the reading itself."""
    if world_size() == 1:
        return reading
    t = torch.tensor([reading], dtype=torch.float64)
    dist.broadcast(t, 0, group=_STATE.objects)
    return float(t.item())


def stage_layers(num_layers: int, stage: int | None = None, stages: int | None = None) -> range:
    """The decoder layers of pipeline stage `stage` (default: this process's): contiguous and
    as equal as possible, earlier stages taking one more where they do not divide (the last
    stage also runs the final norm and the LM head)."""
    stage = _STATE.pp_rank if stage is None else stage
    stages = _STATE.pp_size if stages is None else stages
    if num_layers < stages:
        raise ValueError(f"num_hidden_layers={num_layers} cannot be cut into pipeline_parallel_size={stages} stages")
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def send_next(x: torch.Tensor) -> Any:
    """Send hidden rows to this tensor-parallel rank of the next stage, without waiting: the
    returned handle's wait() must come before `x` is reused."""
    return dist.isend(x.contiguous(), _STATE.world_rank + _STATE.size)


def recv_prev(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The hidden rows this stage's counterpart in the previous stage sent."""
    x = torch.empty(shape, dtype=dtype, device=device)
    t0 = time.perf_counter()
    dist.recv(x, _STATE.world_rank - _STATE.size)
    _STATE.recv_wait += time.perf_counter() - t0
    return x


def recv_wait_seconds() -> float:
    """Seconds this process has spent waiting in recv_prev (a pipeline stage's share of the
    bubble: idle until the previous stage's rows arrive)."""
    return _STATE.recv_wait


def broadcast_from_stage(x: torch.Tensor, stage: int) -> torch.Tensor:
    """`x` as the first tensor-parallel rank of pipeline stage `stage` holds it, on every rank
    (in place; the other ranks pass a tensor of the same shape and dtype)."""
    if world_size() > 1:
        dist.broadcast(x, stage * _STATE.size)
    return x


def agree_min(n: int) -> int:
    """The smallest of every rank's `n` (a KV-cache size every rank can hold, so that their
    schedules stay identical)."""
    if world_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_STATE.objects)
    return int(t.item())


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
        dist.all_reduce(x, group=_STATE.group)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """The ranks' tensors side by side along the last dimension (rank order)."""
    if _STATE.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x, group=_STATE.group)
    return torch.cat(parts, dim=-1)


def gather_objects(obj: Any) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if world_size() == 1:
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj, group=_STATE.objects)
    return out


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
