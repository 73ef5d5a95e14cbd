"""Locust load test for `leapfrog serve`, for people who already use locust (pip install locust).

    locust -f locustfile.py --host http://127.0.0.1:8080 --users 8 --spawn-rate 8 \
           --run-time 60s --headless --csv bench_results/locust

Each user streams /v1/completions. Besides locust's own per-request row (whole-stream time),
two custom rows are reported so the CSV carries the serving metrics that matter:
`TTFT` (time to the first text chunk) and `TPOT` (per output token after the first, from the
server's usage count). Environment: LEAPFROG_BENCH_MODEL (default: the server's first model),
LEAPFROG_BENCH_MAX_TOKENS (128), LEAPFROG_API_KEY (sent as a bearer token if set).
`leapfrog bench --serve` is the reference benchmark; this file is for dashboards and soak tests.
"""
from __future__ import annotations

import json
import os
import random
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
            if first is None:
                resp.failure("no tokens streamed")
                return
            resp.success()
        fire("TTFT", (first - start) * 1000)
        if tokens > 1:
            fire("TPOT", (end - first) * 1000 / (tokens - 1))


def fire(name: str, ms: float) -> None:
    """A custom row in locust's statistics (response_time in ms, as locust expects)."""
    events.request.fire(request_type="metric", name=name, response_time=ms, response_length=0,
                        exception=None, context={})
