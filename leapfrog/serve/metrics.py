"""Prometheus metrics for the server, exposed through prometheus_client.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

# The text format the samples are written in (prometheus_client's CONTENT_TYPE_LATEST names a newer
# version of the format than generate_latest writes).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

PREFIX = "leapfrog:"

# Latency buckets in seconds: fine at the low end, where CPU decode steps of small models live.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKENS_PER_FORWARD_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)

HISTOGRAMS = {
    "time_to_first_token_seconds": ("Time from arrival to the first generated token.", LATENCY_BUCKETS),
    "inter_token_latency_seconds": ("Time between consecutive streamed outputs, per token.", LATENCY_BUCKETS),
    "time_per_output_token_seconds": ("Per request: (e2e - ttft) / (output tokens - 1).", LATENCY_BUCKETS),
    "e2e_request_latency_seconds": ("Time from arrival to the last token.", LATENCY_BUCKETS),
    "request_tokens_per_forward": ("Per request: output tokens per main-model forward.", TOKENS_PER_FORWARD_BUCKETS),
}
COUNTERS = {
    "prompt_tokens": "Prompt tokens processed.",
    "generation_tokens": "Tokens generated.",
    "request_forwards": "Main-model forward passes that produced output, summed over requests.",
    "num_preemptions": "Requests preempted (recomputed) for lack of KV blocks.",
    "http_requests_rejected": "Requests rejected before reaching the engine, by reason.",
    "engine_restarts": "Times the engine loop died and was rebuilt (its requests in flight got an error).",
}
# Read from the engine thread's last snapshot (ServerMetrics.publish).
GAUGES = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV-cache blocks in use (0-1).",
    "kv_cache_num_blocks": "KV-cache blocks in total.",
    "kv_cache_used_blocks": "KV-cache blocks held by requests (cached-but-free blocks excluded).",
    "tokens_per_forward": "Output tokens per main-model forward, over all finished requests.",
}
ENGINE_COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache (either tier).",
    "prefix_cache_tier2_hits": "Prompt tokens of those found in its second tier (kv_spill_bytes).",
    "prefix_cache_tier3_hits": "Prompt tokens of those found in its third tier, shared between replicas (kv_remote_url).",
    "engine_steps": "Engine steps (batched forward passes).",
    "engine_interrupted_steps": "Steps and multi-step decode calls cut short for a request that arrived "
                                "(background steps are abandoned part-way).",
}


def _le(edge: float) -> str:
    """A bucket bound as the `le` label has always been written: 1 -> "1", 0.25 -> "0.25"."""
    if edge == math.inf:
        return "+Inf"
    return str(int(edge)) if float(edge).is_integer() else repr(float(edge))


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)    # per bucket, not cumulative; above the last: none
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)      # the first bound >= value
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for edge, n in zip(self.buckets, self.counts):
            running += n
            out.append((_le(edge), running))
        out.append(("+Inf", self.count))
        return out


class HTTPResponses:
    """HTTP responses by status code, counted at the ASGI layer for every route (errors from
    validation, authentication and unknown routes included): the server's own count of 4xx and
    5xx, which the reliability benchmark and the error-rate alert read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[int, int] = {}

    def add(self, status: int) -> None:
        with self._lock:
            self.counts[status] = self.counts.get(status, 0) + 1

    def collect(self) -> list[Metric]:
        family = CounterMetricFamily(PREFIX + "http_responses", "HTTP responses sent, by status code.",
                                     labels=["status"])
        with self._lock:
            for status, n in sorted(self.counts.items()):
                family.add_metric([str(status)], n)
        return [family]


class CountResponses:
    """ASGI middleware: counts each response's status into an HTTPResponses (plain ASGI, so a
    streamed body is not copied through a queue)."""

    def __init__(self, app, counter: HTTPResponses) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        started = False

        async def counted(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counter.add(int(message["status"]))
            await send(message)
        try:
            await self.app(scope, receive, counted)
        except Exception:       # the app's catch-all handler, outside this middleware, answers 500
            if not started:
                self.counter.add(500)
            raise


def render_all(metrics: list["ServerMetrics"], extra: tuple = ()) -> str:
    """The exposition of several models' metrics (one ServerMetrics per served model): each
    family once, with every model's samples under it, told apart by `model_name`; then the
    process's own (resident memory, CPU seconds, open files: prometheus_client's standard
    `process_*` series), once."""
    merged: dict[str, Metric] = {}
    for m in metrics:
        for family in m.collect():
            if family.name in merged:
                merged[family.name].samples.extend(family.samples)
            else:
                merged[family.name] = family

    for collector in extra:
        for family in collector.collect():
            merged.setdefault(family.name, family)
    for family in ProcessCollector(registry=None).collect():
        merged.setdefault(family.name, family)

    class _Merged:
        def collect(self) -> list[Metric]:
            return list(merged.values())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry).decode()


def _method_metric_name(key: str) -> str:
    """`method_` + the key with anything but ASCII letters and digits turned into `_`."""
    return "method_" + "".join(c if c.isascii() and c.isalnum() else "_" for c in key)


class ServerMetrics:
    """Everything /metrics shows. Gauges are read from the engine thread's last snapshot.

    Each instance has its own CollectorRegistry (several servers may run in one process, as in the
    tests), with the instance itself registered as its collector. Once engine ranks or replicas run
    in processes of their own, prometheus_client's multiprocess mode is the way to sum them: the
    processes record through the library's Counter/Gauge/Histogram with PROMETHEUS_MULTIPROC_DIR
    set, and `prometheus_client.multiprocess.MultiProcessCollector(self.registry)` joins this
    registry; render() stays as it is.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self.hist = {name: Histogram(buckets) for name, (_, buckets) in HISTOGRAMS.items()}
        self.counters: dict[str, float] = {name: 0 for name in COUNTERS}
        self.success: dict[str, int] = {}          # finished_reason -> count
        self.rejected: dict[str, int] = {}         # reason -> count
        # reason -> count of requests turned away before they named a model (authentication,
        # rate limit, every model full): shown under model_name="", not under this model's name
        self.rejected_unrouted: dict[str, int] = {}
        self.snapshot: dict[str, float] = {}       # engine gauges and cumulative engine counters
        self.method_stats: dict[str, float] = {}
        self.method_name = ""
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self.hist[name].observe(value)

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self.counters[name] += value

    def finished(self, reason: str) -> None:
        with self._lock:
            self.success[reason] = self.success.get(reason, 0) + 1

    def reject(self, reason: str, routed: bool = True) -> None:
        with self._lock:
            counts = self.rejected if routed else self.rejected_unrouted
            counts[reason] = counts.get(reason, 0) + 1

    def publish(self, snapshot: dict[str, float], method_name: str, method_stats: dict[str, float]) -> None:
        with self._lock:
            self.snapshot, self.method_name, self.method_stats = snapshot, method_name, method_stats

    # --- exposition ---------------------------------------------------------------------
    def render(self) -> str:
        """The Prometheus text format (CONTENT_TYPE) of everything in the registry."""
        return generate_latest(self.registry).decode()

    def collect(self) -> list[Metric]:
        """The collector interface: the current values as metric families, built under the lock
        and formatted by prometheus_client after it is released."""
        model = [self.model_name]
        with self._lock:
            s = self.snapshot
            families: list[Metric] = []
            for name, doc in GAUGES.items():
                families.append(GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"]))
                families[-1].add_metric(model, s.get(name, 0.0))
            for name, doc in ENGINE_COUNTERS.items():
                families.append(CounterMetricFamily(PREFIX + name, doc, labels=["model_name"]))
                families[-1].add_metric(model, s.get(name, 0))
            for name, doc in COUNTERS.items():
                if name != "http_requests_rejected":
                    families.append(CounterMetricFamily(PREFIX + name, doc, labels=["model_name"]))
                    families[-1].add_metric(model, self.counters[name])
            families.append(self._labelled_counter("request_success", "Finished requests, by finish reason.",
                                                   "finished_reason", self.success))
            families.append(self._labelled_counter("http_requests_rejected", COUNTERS["http_requests_rejected"],
                                                   "reason", self.rejected))
            for reason, n in sorted(self.rejected_unrouted.items()):
                families[-1].add_metric(["", reason], n)
            for name, (doc, _) in HISTOGRAMS.items():
                h = self.hist[name]
                families.append(HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"]))
                families[-1].add_metric(model, h.cumulative(), h.total)
            families += self._method_families()
        return families

    def _labelled_counter(self, name: str, doc: str, label: str, counts: dict[str, int]) -> Metric:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", label])
        for value, n in sorted(counts.items()):
            family.add_metric([self.model_name, value], n)
        return family

    def _method_families(self) -> list[Metric]:
        """Whatever the decoding method counts (Method.stats(): drafted / accepted tokens,
        denoising steps), one family per key so names stay stable as methods add keys.
        `num_*` keys are counters (leapfrog:method_num_accepted_tokens_total); others,
        such as ratios, are gauges."""
        out: list[Metric] = []
        for key, value in sorted(self.method_stats.items()):
            name = PREFIX + _method_metric_name(key).removesuffix("_total")
            kind = CounterMetricFamily if key.startswith("num_") else GaugeMetricFamily
            family = kind(name, f"Decoding-method statistic {key!r}.", labels=["model_name", "method"])
            family.add_metric([self.model_name, self.method_name], float(value))
            out.append(family)
        return out
