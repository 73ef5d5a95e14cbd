"""Prometheus metrics for the server, written in the text exposition format by hand.

Names follow vLLM's (research/serving.md §1.2) under a `leapfrog:` prefix, so dashboards and
benchmark scrapers built for vLLM need only the prefix changed. Observations come from the
engine thread and rendering from the event loop, hence the lock.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

# Latency buckets in seconds: fine at the low end, where CPU decode steps of small models live.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKENS_PER_FORWARD_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(x: float) -> str:
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) < 1e15):
        return str(int(x))
    return "+Inf" if x == math.inf else repr(float(x))


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1
                break
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: dict[str, str]) -> list[str]:
        out, running = [], 0
        for edge, n in zip(self.buckets, self.counts):
            running += n
            out.append(f"{name}_bucket{_labels({**labels, 'le': _num(edge)})} {running}")
        out.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {self.count}")
        out.append(f"{name}_sum{_labels(labels)} {_num(self.total)}")
        out.append(f"{name}_count{_labels(labels)} {self.count}")
        return out


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
}


class ServerMetrics:
    """Everything /metrics shows. Gauges are read from the engine thread's last snapshot."""

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self._lock = threading.Lock()
        self.hist = {name: Histogram(buckets) for name, (_, buckets) in HISTOGRAMS.items()}
        self.counters: dict[str, float] = {name: 0 for name in COUNTERS}
        self.success: dict[str, int] = {}          # finished_reason -> count
        self.rejected: dict[str, int] = {}         # reason -> count
        self.snapshot: dict[str, float] = {}       # engine gauges and cumulative engine counters
        self.method_stats: dict[str, float] = {}
        self.method_name = ""

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self.hist[name].observe(value)

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self.counters[name] += value

    def finished(self, reason: str) -> None:
        with self._lock:
            self.success[reason] = self.success.get(reason, 0) + 1

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def publish(self, snapshot: dict[str, float], method_name: str, method_stats: dict[str, float]) -> None:
        with self._lock:
            self.snapshot, self.method_name, self.method_stats = snapshot, method_name, method_stats

    # --- exposition ---------------------------------------------------------------------
    def render(self) -> str:
        with self._lock:
            lines: list[str] = []
            self._render_gauges(lines)
            self._render_counters(lines)
            for name, (doc, _) in HISTOGRAMS.items():
                self._header(lines, name, doc, "histogram")
                lines += self.hist[name].lines(f"leapfrog:{name}", self.labels)
            self._render_method(lines)
        return "\n".join(lines) + "\n"

    @staticmethod
    def _header(lines: list[str], name: str, doc: str, kind: str) -> None:
        lines.append(f"# HELP leapfrog:{name} {doc}")
        lines.append(f"# TYPE leapfrog:{name} {kind}")

    def _one(self, lines: list[str], name: str, doc: str, kind: str, value: float,
             extra: dict[str, str] | None = None) -> None:
        suffix = "_total" if kind == "counter" else ""
        self._header(lines, name + suffix if kind == "counter" else name, doc, kind)
        lines.append(f"leapfrog:{name}{suffix}{_labels({**self.labels, **(extra or {})})} {_num(value)}")

    def _render_gauges(self, lines: list[str]) -> None:
        s = self.snapshot
        gauges = {
            "num_requests_running": "Requests in the running batch.",
            "num_requests_waiting": "Requests waiting to be scheduled.",
            "kv_cache_usage_perc": "Fraction of KV-cache blocks in use (0-1).",
            "kv_cache_num_blocks": "KV-cache blocks in total.",
            "kv_cache_used_blocks": "KV-cache blocks held by requests (cached-but-free blocks excluded).",
            "tokens_per_forward": "Output tokens per main-model forward, over all finished requests.",
        }
        for name, doc in gauges.items():
            self._one(lines, name, doc, "gauge", s.get(name, 0.0))

    def _render_counters(self, lines: list[str]) -> None:
        s = self.snapshot
        engine_counters = {
            "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
            "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
            "engine_steps": "Engine steps (batched forward passes).",
        }
        for name, doc in engine_counters.items():
            self._one(lines, name, doc, "counter", s.get(name, 0))
        for name, doc in COUNTERS.items():
            if name != "http_requests_rejected":
                self._one(lines, name, doc, "counter", self.counters[name])
        self._header(lines, "request_success_total", "Finished requests, by finish reason.", "counter")
        for reason, n in sorted(self.success.items()):
            lines.append(f"leapfrog:request_success_total{_labels({**self.labels, 'finished_reason': reason})} {n}")
        self._header(lines, "http_requests_rejected_total", COUNTERS["http_requests_rejected"], "counter")
        for reason, n in sorted(self.rejected.items()):
            lines.append(f"leapfrog:http_requests_rejected_total{_labels({**self.labels, 'reason': reason})} {n}")

    def _render_method(self, lines: list[str]) -> None:
        """Whatever the decoding method counts (Method.stats(): drafted / accepted tokens,
        denoising steps), one family per key so names stay stable as methods add keys.
        `num_*` keys are counters (leapfrog:method_num_accepted_tokens_total); others,
        such as ratios, are gauges."""
        for key, value in sorted(self.method_stats.items()):
            name = "method_" + "".join(c if c.isalnum() else "_" for c in key)
            kind = "counter" if key.startswith("num_") else "gauge"
            self._one(lines, name.removesuffix("_total"), f"Decoding-method statistic {key!r}.", kind,
                      float(value), {"method": self.method_name})
