"""One engine over several ranks (tensor-parallel shards, pipeline stages, or both): rank 0
drives, the others follow its schedule.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import sys
import threading
from typing import Any

import torch

from leapfrog.engine.llm_engine import LLMEngine
from leapfrog.layers import parallel as tp

log = logging.getLogger("leapfrog.engine.distributed")

# Methods that run over several ranks. Their schedule depends only on the engine's calls; what
# is decided from measured time (confidence-scheduled verification) reads rank 0's clock.
PARALLEL_METHODS = ("ar", "dflash", "dspark", "diffusion")


class RankDied(BaseException):
    """A follower rank is gone: fatal for this engine (under `leapfrog serve`, the engine
    supervisor fails the requests in flight and rebuilds the engine, ranks included). A
    BaseException, so that no per-request error handling mistakes it for one request's fault."""


def sizes(options: dict) -> tuple[int, int]:
    """(tensor_parallel_size, pipeline_parallel_size) of engine options."""
    return (int(options.get("tensor_parallel_size", 1) or 1), int(options.get("pipeline_parallel_size", 1) or 1))


def num_ranks(options: dict) -> int:
    """Processes an engine with these options runs on."""
    t, p = sizes(options)
    return t * p


def check_method(method: str) -> None:
    if method not in PARALLEL_METHODS:
        raise ValueError(f"tensor_parallel_size / pipeline_parallel_size > 1 support the {', '.join(PARALLEL_METHODS)} "
                         f"method for now, not {method!r}")


def _follower_main(rank: int, size: int, init_method: str, model: str, kwargs: dict) -> None:
    """A spawned follower: join the group, build its part's engine, follow rank 0. An error here
    is rank 0's too (the same options on every rank), which says it in full: one line here."""
    try:
        torch.set_num_threads(max(1, kwargs.pop("_threads_per_rank", 1)))
        tp.init(rank, size, init_method, pipeline_size=sizes(kwargs)[1])
        engine = LLMEngine(model, **kwargs)
        follow(engine)
        tp.shutdown()
    except KeyboardInterrupt:             # Ctrl-C reaches every rank; rank 0 reports it
        sys.exit(1)
    except Exception as exc:
        print(f"leapfrog rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)


def follow(engine: Any) -> None:
    """Make rank 0's calls until it says stop."""
    while True:
        call, args, kwargs = tp.broadcast_object()
        if call == "stop":
            return
        try:
            getattr(engine, call)(*args, **kwargs)
        except (ValueError, TypeError):     # rank 0 raised the same (a refused request) and carries on
            pass


class TensorParallelEngine:
    """Rank 0's engine: each state-changing call is broadcast to the followers, then made here."""

    def __init__(self, engine: Any, followers: list | None = None) -> None:
        self.engine = engine
        self.followers = followers or []
        self._stopped = False
        # A call cut off part way (Ctrl-C in a step's collectives, a rank gone) leaves the ranks
        # out of step: no further collective can complete, shutdown included.
        self._broken: BaseException | None = None
        atexit.register(self.shutdown)

    def _check(self, wait: float = 0.0) -> None:
        """Raise RankDied if a follower is gone (`wait`: give a process just killed time to be
        reaped, after a collective failed)."""
        for p in self.followers:
            if wait and p.is_alive():
                p.join(wait)
        dead = [p for p in self.followers if not p.is_alive()]
        if dead:
            raise RankDied(f"rank(s) {', '.join(str(self.followers.index(p) + 1) for p in dead)} "
                           f"died (exit code {dead[0].exitcode}); the engine cannot go on")

    def _guarded(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """A call that runs collectives: a peer that died mid-call shows up as the transport's
        error (gloo: connection reset); that is RankDied, not a fault of the request."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:
            try:
                self._check(wait=1.0)
            except RankDied as dead:
                raise dead from exc
            msg = str(exc).lower()
            if tp.world_size() > 1 and ("gloo" in msg or "nccl" in msg or "shared-memory collective" in msg):
                raise RankDied(f"a collective failed: {exc}") from exc
            raise

    def _send(self, call: str, *args: Any, **kwargs: Any) -> None:
        self._check()
        self._guarded(tp.broadcast_object, (call, args, kwargs))

    def _call(self, call: str, *args: Any, **kwargs: Any) -> Any:
        """`call` on every rank: broadcast, then made here. A ValueError or TypeError (a refused
        request) is raised on every rank alike and leaves them in step; anything else that ends the call part
        way (KeyboardInterrupt, a rank gone) does not."""
        if self._broken is not None:
            raise RankDied(f"an earlier call was cut off ({type(self._broken).__name__}); the ranks are "
                           "out of step and the engine cannot go on") from self._broken
        try:
            self._send(call, *args, **kwargs)
            return self._guarded(getattr(self.engine, call), *args, **kwargs)
        except (ValueError, TypeError):
            raise
        except BaseException as exc:
            self._broken = exc
            raise

    def add_request(self, *args: Any, **kwargs: Any) -> str:
        return self._call("add_request", *args, **kwargs)

    def abort(self, request_id: str) -> None:
        self._call("abort", request_id)

    def step(self) -> list:
        return self._call("step")

    def parallel_stats(self) -> list[dict]:
        """Every rank's pipelined-step counters (runner.PipelineStats), in rank order."""
        return self._call("parallel_stats")

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.shutdown)
        in_step = self._broken is None and all(p.is_alive() for p in self.followers)
        try:
            if in_step:
                tp.broadcast_object(("stop", (), {}))
        finally:
            for p in self.followers:
                if in_step:
                    p.join(timeout=30)
                if p.is_alive():          # out of step: it waits in a collective that never ends
                    p.terminate()
                    p.join(timeout=5)
            tp.shutdown()                 # after the followers are gone: nothing waits on a peer

    def __getattr__(self, name: str) -> Any:       # reads (tokenizer, config, stats, ...) go to the engine
        return getattr(self.engine, name)


def _join_watching(followers: list, size: int, init_method: str, pipeline: int) -> None:
    """Rank 0 joins the group while it watches the followers: one that dies before it joins (a
    script without `if __name__ == "__main__":` under the spawn start method, a crash while it
    imports) is named at once, not after the rendezvous' timeout."""
    failed: list[BaseException] = []

    def join() -> None:
        try:
            tp.init(0, size, init_method, pipeline_size=pipeline)
        except BaseException as exc:      # handed to the caller's thread
            failed.append(exc)
    joiner = threading.Thread(target=join, name="leapfrog-tp-join", daemon=True)
    joiner.start()
    while joiner.is_alive():
        joiner.join(0.1)
        dead = [p for p in followers if not p.is_alive()]
        if dead and joiner.is_alive():
            for p in followers:
                p.terminate()
            raise RuntimeError(f"rank {followers.index(dead[0]) + 1} exited (code {dead[0].exitcode}) before "
                               "joining the group; a script that starts ranks needs its work under "
                               "`if __name__ == \"__main__\":` (the ranks are spawned processes)")
    if failed:
        raise failed[0]


def start(model: str, kwargs: dict) -> Any:
    """The engine for `tensor_parallel_size` x `pipeline_parallel_size` ranks: followers spawned
    here (or, under torchrun, this process's rank); on rank 0 a TensorParallelEngine, on a
    follower rank never returns."""
    check_method(str(kwargs.get("method", "ar")))
    t, pipeline = sizes(kwargs)
    size = t * pipeline
    if tp.launched_by_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(f"tensor_parallel_size={t} x pipeline_parallel_size={pipeline} = {size} ranks, "
                             f"but torchrun started {world} processes")
        tp.init(rank, world, pipeline_size=pipeline)
        engine = LLMEngine(model, **kwargs)
        if rank != 0:
            follow(engine)
            tp.shutdown()
            raise SystemExit(0)
        return TensorParallelEngine(engine)
    init_method = f"tcp://127.0.0.1:{tp.free_port()}"
    threads = max(1, (os.cpu_count() or size) // size)
    ctx = mp.get_context("spawn")
    followers = [ctx.Process(target=_follower_main, args=(r, size, init_method, model,
                                                          {**kwargs, "_threads_per_rank": threads}),
                             name=f"leapfrog-tp-rank{r}", daemon=True) for r in range(1, size)]
    for p in followers:
        p.start()
    torch.set_num_threads(threads)
    _join_watching(followers, size, init_method, pipeline)
    try:
        engine = LLMEngine(model, **kwargs)
    except BaseException:
        for p in followers:
            p.terminate()
        tp.shutdown()
        raise
    log.info("%d ranks on this machine (tensor parallel %d x pipeline parallel %d), %d threads each",
             size, t, pipeline, threads)
    return TensorParallelEngine(engine, followers)
