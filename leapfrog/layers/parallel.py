"""Tensor and pipeline parallelism's process groups and collectives, on torch.distributed (gloo
on CPUs, NCCL on GPUs).
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import os
import platform
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
    shm: Any = None              # _ShmGroup: the tensor-parallel collectives through shared memory


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
    _STATE.shm = _ShmGroup.create(backend)


class _ShmGroup:
    """All-reduce and all-gather of the tensor-parallel group through shared memory, for ranks
    on one machine on a CPU (gloo's loopback TCP costs about a decode step's worth of time per
    all-reduce, and a step has two a layer). Each rank has a slot in two alternating buffers (/dev/shm, unlinked
    once mapped) and a generation flag: it writes its tensor, raises its flag, waits for every
    rank's flag, and sums the slots in rank order (every rank the same sum, bit for bit). A
    rank's slot in one buffer is written again only two collectives later, after every rank
    raised its flag for the one in between, so after everyone has read it. x86's stores become
    visible in program order, which the flags rely on; elsewhere gloo is used. A rank that
    waits checks its peers' processes every few milliseconds: a dead one is an error, not a hang."""
    SLOT = 1 << 20                 # float32 elements per rank and buffer (larger tensors: gloo)
    STRIDE = 16                    # int64s between flags: one cache line each

    def __init__(self, paths: list[str], counts: list[int], rank: int, size: int) -> None:
        """Map the files the group's first rank made (create), then unlink them."""
        self.rank, self.size, self.gen = rank, size, 0
        self.flags = torch.from_file(paths[0], shared=True, size=counts[0], dtype=torch.int64)
        self.data = torch.from_file(paths[1], shared=True, size=counts[1], dtype=torch.float32).view(2, size, -1)
        self._flags = self.flags.numpy()
        self._flags[rank * self.STRIDE + 1] = os.getpid()
        dist.barrier(group=_STATE.group)
        if rank == 0:
            for path in paths:
                os.unlink(path)
        self.pids = [int(self._flags[r * self.STRIDE + 1]) for r in range(size)]

    @classmethod
    def create(cls, backend: str) -> "_ShmGroup | None":
        """For a tensor-parallel group whose ranks all run on this machine, on gloo, on x86, where
        /dev/shm has room for the buffers (their pages are reserved up front: a full /dev/shm,
        Docker's 64 MB default say, then means gloo, not a crash on first write);
        LEAPFROG_SHM_COLLECTIVES=0 keeps gloo. Every rank reaches the same decision."""
        ok = (_STATE.size > 1 and backend == "gloo" and os.environ.get("LEAPFROG_SHM_COLLECTIVES", "1") != "0"
              and platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm"))
        hosts = gather_objects((socket.gethostname(), ok))
        stage = hosts[_STATE.pp_rank * _STATE.size:(_STATE.pp_rank + 1) * _STATE.size]
        if not all(h[1] for h in hosts) or len({h[0] for h in stage}) != 1:
            return None
        name = broadcast_object(f"leapfrog-{os.getpid()}-{os.urandom(4).hex()}" if _STATE.world_rank == 0 else None)
        size = _STATE.size
        paths = [f"/dev/shm/{name}-stage{_STATE.pp_rank}-flags", f"/dev/shm/{name}-stage{_STATE.pp_rank}-data"]
        counts = [size * cls.STRIDE, 2 * size * cls.SLOT]
        made = True
        if _STATE.rank == 0:
            try:
                for path, n, width in zip(paths, counts, (8, 4)):
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                    try:
                        os.posix_fallocate(fd, 0, n * width)
                    finally:
                        os.close(fd)
            except OSError:
                made = False
        if not all(gather_objects(made)):
            if _STATE.rank == 0:
                for path in paths:
                    if os.path.exists(path):
                        os.unlink(path)
            return None
        return cls(paths, counts, _STATE.rank, size)

    def _exchange(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x, as [size, n] rows of the current buffer; None when x does not fit."""
        n = x.numel()
        if n > self.SLOT or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        self.gen += 1
        buf = self.data[self.gen & 1]
        buf[self.rank, :n].copy_(x.reshape(-1))
        flags, gen, stride = self._flags, self.gen, self.STRIDE
        flags[self.rank * stride] = gen
        spins, checked = 0, time.monotonic()
        for r in range(self.size):
            while flags[r * stride] < gen:
                spins += 1
                if spins % 256 == 0:
                    os.sched_yield()
                    if time.monotonic() - checked > 0.005:
                        checked = time.monotonic()
                        self._check_peers()
        return buf[:, :n]

    def _check_peers(self) -> None:
        """Raise if a peer's process is gone or a zombie (a spawned follower that died stays a
        zombie until its parent, rank 0, reaps it)."""
        for r, pid in enumerate(self.pids):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                state = "X"
            if state in ("Z", "X"):
                raise RuntimeError(f"shared-memory collective: rank {r} (pid {pid}) is gone")

    def all_reduce(self, x: torch.Tensor) -> bool:
        rows = self._exchange(x)
        if rows is None:
            return False
        x.copy_(rows.sum(0).view_as(x))
        return True

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor | None:
        rows = self._exchange(x)
        if rows is None:
            return None
        return torch.cat([rows[r].view_as(x) for r in range(self.size)], dim=-1)


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
    _STATE.size, _STATE.rank, _STATE.objects, _STATE.group, _STATE.shm = 1, 0, None, None, None
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
    if _STATE.size > 1 and not (_STATE.shm is not None and x.is_contiguous() and _STATE.shm.all_reduce(x)):
        dist.all_reduce(x, group=_STATE.group)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """The ranks' tensors side by side along the last dimension (rank order)."""
    if _STATE.size == 1:
        return x
    x = x.contiguous()
    out = _STATE.shm.all_gather_last(x) if _STATE.shm is not None else None
    if out is not None:
        return out
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
