"""Locust load test for `leapfrog serve`, for people who already use locust (pip install locust).

    locust -f locustfile.py --host http://127.0.0.1:8080 --users 8 --spawn-rate 8 \
           --run-time 60s --headless --csv bench_results/locust

Each user streams /v1/completions; locust's per-request row is the whole-stream time (from the
request to the last event, not to the response headers). The serving metrics that matter are
kept apart from the request rows, so that locust's aggregate still counts requests only:
`TTFT` (time to the first text chunk) and `TPOT` (per output token after the first, from the
server's usage count) are printed at the end as percentiles and, with --csv PREFIX, written to
PREFIX_serving.csv. Environment: LEAPFROG_BENCH_MODEL (default: the server's first model),
LEAPFROG_BENCH_MAX_TOKENS (128), LEAPFROG_API_KEY (sent as a bearer token if set).
`leapfrog bench --serve` is the reference benchmark; this file is for dashboards and soak tests.
"""
from __future__ import annotations

import csv
import json
import os
import random
import statistics
import time

from locust import HttpUser, between, events, task

PROMPTS = [f"Once upon a time there was a little {w} who liked to {v}."
           for w in ("cat", "dog", "girl", "boy", "bird", "fox") for v in ("play", "sing", "run", "read")]
MAX_TOKENS = int(os.environ.get("LEAPFROG_BENCH_MAX_TOKENS", "128"))


class CompletionUser(HttpUser):
    wait_time = between(0.0, 0.5)

    def on_start(self) -> None:
        key = os.environ.get("LEAPFROG_API_KEY")
        if key:
            self.client.headers["Authorization"] = f"Bearer {key}"
        self.model = os.environ.get("LEAPFROG_BENCH_MODEL") or \
            self.client.get("/v1/models").json()["data"][0]["id"]

    @task
    def stream_completion(self) -> None:
        body = {"model": self.model, "prompt": random.choice(PROMPTS), "max_tokens": MAX_TOKENS,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first, tokens = None, 0
        with self.client.post("/v1/completions", json=body, stream=True, catch_response=True,
                              name="/v1/completions (stream)") as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
                return
            for raw in resp.iter_lines():
                line = raw.decode() if isinstance(raw, bytes) else raw
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = time.perf_counter()
            end = time.perf_counter()
            resp.request_meta["response_time"] = (end - start) * 1000    # the whole stream, in ms
            if first is None:
                resp.failure("no tokens streamed")
                return
            resp.success()
        SAMPLES["TTFT"].append((first - start) * 1000)
        if tokens > 1:
            SAMPLES["TPOT"].append((end - first) * 1000 / (tokens - 1))


SAMPLES: dict[str, list[float]] = {"TTFT": [], "TPOT": []}


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


@events.quitting.add_listener
def report_serving_metrics(environment, **_kw) -> None:
    rows = [[name, len(v), *(round(percentile(v, q), 3) for q in (50, 90, 99))]
            for name, v in SAMPLES.items() if v]
    header = ["metric", "count", "p50_ms", "p90_ms", "p99_ms"]
    for row in [header, *rows]:
        print("  ".join(f"{c:>10}" for c in row))
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if prefix and rows:
        with open(f"{prefix}_serving.csv", "w", newline="") as f:
            csv.writer(f).writerows([header, *rows])
