"""AsyncEngine: one background thread owns the (not thread-safe) LLMEngine.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from leapfrog.engine.llm_engine import release_freed_heap
from leapfrog.layers.parallel import launched_by_torchrun
from leapfrog.outputs import RequestOutput
from leapfrog.sampling_params import BACKGROUND_PRIORITY, ParamError, SamplingParams
from leapfrog.serve.line import DrainRate
from leapfrog.serve.metrics import ServerMetrics

log = logging.getLogger("leapfrog.serve.app")


class RequestTimeout(Exception):
    """The request ran past the server's per-request timeout and was aborted."""


class EngineError(Exception):
    """The engine failed while this request was in flight."""


class InjectedFault(BaseException):
    """Raised in the engine loop by inject_crash (POST /admin/fault): escapes the loop's
    `except Exception`, so the loop dies as it would from a real fault."""


@dataclass(slots=True)
class _Tracked:
    """Per-request timing kept by the engine thread for the latency histograms."""
    sink: asyncio.Queue
    arrival: float
    deadline: float | None
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    tracked: _Tracked
    stream: bool = True


@dataclass(slots=True)
class EngineInfo:
    """Read-only facts about the loaded engine, for the HTTP layer."""
    model_name: str = ""
    max_model_len: int = 0
    method: str = ""
    vocab_size: int = 0
    max_prompt_chars: int = 0          # a longer prompt cannot fit the context: refused untokenized
    constrains: bool = True            # the method applies token masks (structured outputs)
    scores_prompt: bool = True         # the method gives prompt_logprobs
    extra: dict[str, Any] = field(default_factory=dict)


class AsyncEngine:
    def __init__(self, factory: Callable[[], Any], metrics: ServerMetrics, warmup_requests: int = 3,
                 request_timeout: float | None = None, on_loaded: Callable[[], None] | None = None,
                 places: int = 64) -> None:
        self._factory = factory
        self.on_loaded = on_loaded       # after the warm-up, before ready: the server's own preparation
        self.metrics = metrics
        self.warmup_requests = warmup_requests
        self.request_timeout = request_timeout
        self._inbox: queue.Queue = queue.Queue()
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine: Any = None
        self.tokenizer: Any = None
        self.info = EngineInfo()
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.on_fatal: Callable[[], None] | None = None   # called from the thread if loading fails
        self.num_in_flight = 0            # event-loop side count, for the queue limit
        self.places = places              # requests the engine runs at once (max_batch_size)
        self.drain = DrainRate()          # requests finished a second while all places are taken
        self._finished_tokens = 0         # output tokens of finished requests (tokens/forward)
        self._last_publish = 0.0
        self.crash: BaseException | None = None   # what killed the engine loop, until the restart
        self.restarting = False
        self.restarts = 0
        self.last_recovery_s: float | None = None  # death noticed -> ready again, for the last restart
        self._restart_began = 0.0

    # --- lifecycle (event loop side) -------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="leapfrog-engine", daemon=True)
        self._thread.start()

    async def supervise(self, interval: float = 0.1) -> None:
        """Runs on the event loop for the server's life: restarts the engine when its thread dies."""
        while not self._stop.is_set():
            await asyncio.sleep(interval)
            t = self._thread
            if (t is not None and not t.is_alive() and not self._stop.is_set() and self.load_error is None
                    and self.ready.is_set()):
                self._restart()

    def _restart(self) -> None:
        """(Event loop, the dead thread's state is ours now.) Fail what was in flight or queued,
        and build the engine again."""
        self.ready.clear()
        self.restarting = True
        self._restart_began = time.perf_counter()
        self.restarts += 1
        self.metrics.add("engine_restarts", 1)
        why = self.crash
        from leapfrog.engine.distributed import RankDied    # deferred: the rank launcher loads only on a restart
        if isinstance(why, RankDied) and launched_by_torchrun():
            # torchrun's ranks cannot be started again from here: exit, so that torchrun (with
            # --max-restarts) or the orchestrator restarts the whole group.
            log.error("a rank of %s died under torchrun (%s): exiting so that every rank restarts",
                      self.info.model_name, why)
            self.load_error = why
            self._fail_tracked(EngineError(f"a rank of the model died ({why}); the server is restarting"))
            if self.on_fatal is not None:
                self.on_fatal()
            return
        error = EngineError(f"the engine stopped while this request was in flight ({why!r}); it is restarting, "
                            "retry in a few seconds")
        log.error("engine of %s died (%r): failing %d requests in flight and restarting it",
                  self.info.model_name, why, len(self._tracked))
        self._fail_tracked(error)

    def _fail_tracked(self, error: Exception) -> None:
        for request_id, tracked in self._tracked.items():
            tracked.sink.put_nowait((request_id, error))
            self.metrics.finished("error")
        self._tracked.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Add):
                item.tracked.sink.put_nowait((item.request_id, error))
        old, self.crash, self.engine = self.engine, None, None
        if hasattr(old, "shutdown"):        # tensor parallel: stop the follower ranks first
            try:
                old.shutdown()
            except Exception:
                log.exception("stopping the old engine's ranks")
        self._thread = threading.Thread(target=self._run, name="leapfrog-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        if hasattr(self.engine, "shutdown"):       # tensor parallel: the follower ranks
            self.engine.shutdown()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.load_error is None

    # --- requests (event loop side) --------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: asyncio.Queue,
               priority: int = 0, arrival: float | None = None, stream: bool = True) -> str:
        """Queue a request; its outputs (or an exception) arrive on `sink` as (id, item)."""
        request_id = f"req-{next(self._ids)}"
        arrival = arrival or time.perf_counter()
        deadline = arrival + self.request_timeout if self.request_timeout else None
        tracked = _Tracked(sink, arrival, deadline, len(prompt_ids))
        self._inbox.put(_Add(request_id, prompt_ids, params, priority, tracked, stream))
        if priority < BACKGROUND_PRIORITY and self.engine is not None:
            self.engine.interrupt_background()
        return request_id

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def inject_crash(self) -> None:
        """The engine loop dies at its next turn (fault injection, for recovery drills)."""
        self._inbox.put(("crash", None))

    # --- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        if not self._load():
            return
        try:
            self._serve()
        except BaseException as exc:     # the loop died: the supervisor fails its requests, restarts it
            self.crash = exc
            log.error("engine loop of %s died: %r", self.info.model_name, exc)
            traceback.print_exc()
            return
        for request_id in list(self._tracked):   # stop() after graceful drain: nothing left normally
            self._abort(request_id, EngineError("server is shutting down"))

    def _load(self) -> bool:
        try:
            self.engine = self._factory()
            self.tokenizer = self.engine.tokenizer
            e = self.engine
            method = getattr(e, "method", None)
            self.info = EngineInfo(e.model_name, e.max_model_len, e.method_name,
                                   int(e.hf_config.get("vocab_size", 0)),
                                   max_prompt_chars(self.tokenizer, e.max_model_len),
                                   constrains=bool(getattr(method, "supports_logits_processors", True)),
                                   scores_prompt=bool(getattr(method, "supports_prompt_logprobs", True)))
            self._warmup()
            if self.on_loaded is not None:
                self.on_loaded()
            # The model, tokenizer and dictionaries are hundreds of thousands of objects that live as
            # long as the process: out of the collector's way, a full collection no longer walks
            # them, which would stall the event loop (and every probe and stream) for a tenth of a
            # second or more under load.
            gc.collect()
            gc.freeze()
            release_freed_heap()             # what loading and warm-up freed leaves the process
        except BaseException as exc:       # surfaced by /health and the startup log
            self.load_error = exc
            log.error("engine failed to load: %s", exc)
            if not isinstance(exc, (ValueError, FileNotFoundError)):    # a bad option or file says it all
                traceback.print_exc()
            if self.on_fatal is not None:
                self.on_fatal()
            return False
        self._publish(force=True)
        self.ready.set()
        if self.restarting:
            self.restarting = False
            self.last_recovery_s = time.perf_counter() - self._restart_began
            log.warning("engine of %s restarted in %.2fs", self.info.model_name, self.last_recovery_s)
        else:
            log.info("engine ready: %s (%s), context %d", self.info.model_name, self.info.method,
                     self.info.max_model_len)
        return True

    def _serve(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self.engine.clear_interrupt()      # before the inbox: a request queued after it interrupts
                self._drain_inbox(block=not self.engine.has_unfinished())
                self._expire()
                if self.engine.has_unfinished():
                    self._step()
                self._publish()
                failures = 0
            except Exception:           # a bug in bookkeeping must not stop serving...
                log.exception("engine loop error")
                failures += 1
                if failures >= MAX_LOOP_FAILURES:    # ...unless it repeats: rebuild the engine
                    raise

    def _warmup(self) -> None:
        """A few requests of different lengths, so first real requests do not pay for lazy
        allocations and kernel selection, and readiness means 'answers at full speed'."""
        e = self.engine
        lengths = [4, 32, 128, 512][:max(0, self.warmup_requests)]
        for k, n in enumerate(lengths):
            n = max(1, min(n, e.max_model_len - 9))
            ids = [(7 * i + 3) % max(2, self.info.vocab_size) for i in range(n)]
            e.add_request(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                          request_id=f"warmup-{k}")
        while e.has_unfinished():
            e.step()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:           # None only wakes the thread (stop)
                self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: Any) -> None:
        if isinstance(item, _Add):
            try:
                self.engine.add_request(item.prompt_ids, item.params, item.request_id, item.priority,
                                        stream=item.stream)
            except ValueError as exc:
                self._deliver([(item.tracked.sink, (item.request_id, exc))])
                return
            except BaseException:           # the loop dies here: the supervisor fails this one too
                self._tracked[item.request_id] = item.tracked
                raise
            self._tracked[item.request_id] = item.tracked
            self.metrics.add("prompt_tokens", item.tracked.num_prompt_tokens)
        elif item[0] == "abort":
            self._abort(item[1], None)
        elif item[0] == "crash":
            raise InjectedFault("fault injected through POST /admin/fault")

    def _abort(self, request_id: str, reason: BaseException | None) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        self.engine.abort(request_id)       # frees its KV blocks now
        self.metrics.finished("abort" if reason is None else "timeout" if isinstance(reason, RequestTimeout)
                              else "error")
        if reason is not None:
            self._deliver([(tracked.sink, (request_id, reason))])

    def _expire(self) -> None:
        now = time.perf_counter()
        for request_id, t in list(self._tracked.items()):
            if t.deadline is not None and now > t.deadline:
                self._abort(request_id, RequestTimeout(f"request exceeded the {self.request_timeout:g}s timeout"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:       # fail the requests in flight, keep serving new ones
            log.exception("engine step failed")
            for request_id in list(self._tracked):
                self._abort(request_id, EngineError(f"engine error: {exc}"))
            return
        now = time.perf_counter()
        batch = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            if out.finished and (out.finish_reason or "").startswith("error"):
                del self._tracked[out.request_id]
                self.metrics.finished("error")
                batch.append((tracked.sink, (out.request_id, _error_of(out.finish_reason))))
                continue
            self._record(tracked, out, now)
            if out.finished:
                del self._tracked[out.request_id]
            batch.append((tracked.sink, (out.request_id, out)))
        if batch:
            self._deliver(batch)

    def _record(self, t: _Tracked, out: RequestOutput, now: float) -> None:
        m = self.metrics
        n_new = len(out.delta_token_ids)
        if n_new:
            if t.first_token is None:
                t.first_token = now
                m.observe("time_to_first_token_seconds", now - t.arrival)
            else:
                gap = (now - t.last_token) / n_new
                for _ in range(n_new):
                    m.observe("inter_token_latency_seconds", gap)
            t.last_token = now
            t.num_tokens += n_new
            m.add("generation_tokens", n_new)
        if not out.finished:
            return
        m.finished(out.finish_reason or "unknown")
        m.observe("e2e_request_latency_seconds", now - t.arrival)
        if t.first_token is not None and t.num_tokens > 1:
            m.observe("time_per_output_token_seconds", (now - t.first_token) / (t.num_tokens - 1))
        if out.metrics.num_forwards:
            m.observe("request_tokens_per_forward", out.metrics.tokens_per_forward)
            m.add("request_forwards", out.metrics.num_forwards)
            self._finished_tokens += out.metrics.num_output_tokens
        m.add("num_preemptions", out.metrics.num_preemptions)

    def _deliver(self, batch: list[tuple[asyncio.Queue, tuple]]) -> None:
        self._loop.call_soon_threadsafe(_put_all, batch)

    def _publish(self, force: bool = False) -> None:
        """Copy engine gauges for /metrics at most every 50 ms (reading them from the event
        loop would race with the step)."""
        now = time.perf_counter()
        if not force and now - self._last_publish < 0.05:
            return
        self._last_publish = now
        e, bm = self.engine, self.engine.block_manager
        gen = self._finished_tokens
        fwd = self.metrics.counters["request_forwards"]
        snapshot = {
            "num_requests_running": e.num_running, "num_requests_waiting": e.num_waiting,
            "kv_cache_usage_perc": bm.num_used_blocks / bm.num_blocks, "kv_cache_num_blocks": bm.num_blocks,
            "kv_cache_used_blocks": bm.num_used_blocks,
            "prefix_cache_queries": bm.num_prefix_queries, "prefix_cache_hits": bm.num_prefix_hits,
            "prefix_cache_tier2_hits": bm.num_tier_hits, "prefix_cache_tier3_hits": bm.num_remote_hits,
            "engine_steps": e.stats.num_steps, "engine_interrupted_steps":
                e.stats.num_interrupted_steps + e.decode_loop.num_interrupted_calls,
            "tokens_per_forward": gen / fwd if fwd else 0.0,
        }
        self.metrics.publish(snapshot, e.method_name, dict(e.method.stats()))


MAX_LOOP_FAILURES = 3      # loop errors in a row that count as the loop dying


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """An upper bound on the characters of a prompt that fits the context: no token covers more
    characters than its piece has (byte-level and SentencePiece pieces alike); doubled for
    normalizers that shorten text. Checking it before tokenizing keeps a 20 MB prompt from
    costing seconds of CPU."""
    longest = 1
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_token(i)
        longest = max(longest, len(piece) if piece else 1)
    return 2 * longest * max_model_len + 1024


def _error_of(finish_reason: str) -> Exception:
    """The engine finishes a request that failed on its own with reason 'error:<why>';
    'error:param:<field>:<message>' is the request's own fault, a 400 naming the field."""
    why = finish_reason.partition(":")[2]
    if why.startswith("param:"):
        field, _, message = why[len("param:"):].partition(":")
        return ParamError(field, message)
    if why == "kv_cache_too_small":      # the request's size, not the server's fault: a 400
        return ValueError("the request (its prompt and max_tokens) needs more KV cache than this server has "
                          "(kv_cache_tokens); shorten the prompt or lower max_tokens")
    return EngineError(f"this request failed: {why or 'unknown error'}")


def _put_all(batch: list[tuple[asyncio.Queue, tuple]]) -> None:
    for sink, item in batch:
        sink.put_nowait(item)


class Generation:
    """The engine requests behind one HTTP request (n choices x prompts), merged into one
    stream of (choice index, output). close() aborts whatever is unfinished; it is called on
    every exit path, including a client that went away."""

    def __init__(self, engine: AsyncEngine, requests: list[tuple[list[int], SamplingParams]],
                 priority: int = 0, arrival: float | None = None, stream: bool = True) -> None:
        self._engine = engine
        self._sink: asyncio.Queue = asyncio.Queue()
        engine.num_in_flight += len(requests)
        engine.drain.set_saturated(engine.num_in_flight >= engine.places)
        # stream=False: the engine decodes the text once at the end instead of every step
        self._index = {engine.submit(ids, params, self._sink, priority, arrival, stream): i
                       for i, (ids, params) in enumerate(requests)}
        self._live = set(self._index)
        self._closed = False
        self.num_requests = len(requests)

    async def outputs(self, gone: asyncio.Future | None = None):
        """Yields (index, RequestOutput); raises the request's exception if it failed. When
        `gone` (the client went away) resolves first, the requests are aborted and the
        iteration ends, whether tokens are flowing or the requests are still queued."""
        if gone is not None:
            wake = lambda _: self._sink.put_nowait((None, None))     # noqa: E731
            gone.add_done_callback(wake)
        try:
            while self._live:
                request_id, item = await self._sink.get()
                if request_id is None:        # the client went away
                    self.close()
                    return
                if isinstance(item, BaseException):
                    self._live.discard(request_id)
                    self._engine.drain.completed()        # its place is free as a finished one's
                    raise item
                if item.finished:
                    self._live.discard(request_id)
                    self._engine.drain.completed()
                yield self._index[request_id], item
        finally:
            if gone is not None:
                gone.remove_done_callback(wake)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for request_id in self._live:
            self._engine.abort(request_id)
            # a request that leaves (its client went away, a timeout) moves the line on as one
            # that finished does: the wait estimate behind 429s counts it
            self._engine.drain.completed()
        self._live.clear()
        self._engine.num_in_flight -= len(self._index)
        self._engine.drain.set_saturated(self._engine.num_in_flight >= self._engine.places)
