"""The HTTP server, end to end: real uvicorn on a local port, the official openai client for the
OpenAI routes, plain httpx for the rest. Oracles: streamed == non-streamed, concurrent ==
sequential for seeded requests, /generate == /v1/completions for greedy requests."""
from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import openai
import pytest

from test_server_common import ServerThread, pace_engine, still_works


@pytest.fixture(scope="module")
def server(llama_dir):
    s = ServerThread(llama_dir).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_probes_and_models(server, client):
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "healthy" and h["uptime"] > 0 and h["ready"] is True
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200
    ids = [m.id for m in client.models.list()]
    assert ids == ["tiny"]


def test_generate_contract(server):
    r = httpx.post(server.url + "/generate", json={"prompt": "Once upon a time", "max_length": 6, "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and body["num_tokens"] == 6 and body["finish_reason"] == "length"
    assert body["timing"]["total_s"] > 0 and body["prompt_tokens"] > 0 and isinstance(body["text"], str)
    # /generate and /v1/completions are the same engine: greedy text must agree
    r2 = httpx.post(server.url + "/v1/completions",
                    json={"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}).json()
    assert r2["choices"][0]["text"] == body["text"]


def test_completion_stream_equals_non_stream(client):
    kw = dict(model="tiny", prompt="The cat liked to", max_tokens=12, temperature=0.9, seed=7)
    full = client.completions.create(**kw)
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_equals_non_stream(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=10,
              temperature=0.7, seed=3)
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content


def test_sse_wire_format(server):
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"prompt": "Once", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    json.loads(lines[0][6:])


def test_concurrent_streams_equal_sequential(server, client):
    prompts = [f"Once upon a time there was a {w}" for w in ("cat", "dog", "bird", "fox")]

    def streamed(i: int) -> str:
        s = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=12, temperature=1.0,
                                      seed=100 + i, stream=True)
        return "".join(c.choices[0].text for c in s if c.choices)
    sequential = [streamed(i) for i in range(len(prompts))]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = list(pool.map(streamed, range(len(prompts))))
    assert concurrent == sequential
    assert len(set(sequential)) > 1


def test_n_stop_logprobs_priority(server, client):
    r = client.completions.create(model="tiny", prompt="The dog", max_tokens=8, n=3, temperature=1.0, seed=5,
                                  logprobs=2, extra_body={"priority": -1})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    # a stop string cuts the text before it
    base = client.completions.create(model="tiny", prompt="The dog", max_tokens=12, temperature=0).choices[0].text
    stop = base[3:5]
    if stop.strip():
        cut = client.completions.create(model="tiny", prompt="The dog", max_tokens=12, temperature=0, stop=[stop])
        assert cut.choices[0].text == base[:base.index(stop)] and cut.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, logprobs=True, top_logprobs=2, temperature=0)
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens


def test_aborted_stream_frees_kv_blocks(server, monkeypatch):
    pace_engine(monkeypatch, 0.1)     # still decoding when the client hangs up (16 tokens a step)
    assert server.wait_idle() == 0
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"prompt": "Once upon a time", "max_tokens": 200, "stream": True,
                            "ignore_eos": True}, timeout=30) as r:
        it = r.iter_lines()
        for _ in range(3):
            next(it)
        # the gauges are published at most every 50 ms: poll while the request decodes (~1.3 s)
        deadline = time.time() + 0.5
        while server.metric("kv_cache_used_blocks") == 0 and time.time() < deadline:
            time.sleep(0.01)
        assert server.metric("kv_cache_used_blocks") > 0
    # the connection is closed mid-stream: the request must be aborted, its blocks freed
    assert server.wait_idle() == 0
    text = httpx.get(server.url + "/metrics").text
    assert 'finished_reason="abort"' in text
    still_works(server.url)


def test_metrics_families(server):
    still_works(server.url)
    time.sleep(0.1)
    text = httpx.get(server.url + "/metrics").text
    for name in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_count", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "prompt_tokens_total", "generation_tokens_total", "tokens_per_forward"):
        assert f"leapfrog:{name}" in text, name
    assert server.metric("generation_tokens_total") > 0
    assert server.metric("e2e_request_latency_seconds_count") > 0
    assert server.metric("tokens_per_forward") == pytest.approx(1.0)     # ar: one token per forward


def test_generate_stream(server):
    body = {"prompt": "The cat", "max_tokens": 6, "temperature": 0}
    full = httpx.post(server.url + "/generate", json=body).json()
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    assert "".join(e["text"] for e in events) == full["text"]
    assert events[-1]["finished"] and events[-1]["num_tokens"] == 6


def test_batch_prompts_with_n_streamed(client):
    kw = dict(model="tiny", prompt=["The cat", "A dog"], n=2, max_tokens=5, temperature=1.0, seed=11)
    full = client.completions.create(**kw)
    assert sorted(c.index for c in full.choices) == [0, 1, 2, 3]
    texts = {c.index: c.text for c in full.choices}
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == texts
    assert texts[0] != texts[1]            # choice j is seeded with seed + j
