"""Two models behind one server (a tiny Llama first, the built-in `couplets` second): routing
by `model`, /v1/models, one /metrics with both, and the couplet endpoints and page."""
from __future__ import annotations

import re

import httpx
import pytest

from leapfrog.couplet import rules
from test_server_common import ServerThread


@pytest.fixture(scope="module")
def server(llama_dir):
    s = ServerThread(llama_dir, models=[str(llama_dir), "couplets"], served_model_name=None,
                     max_batch_size=16, max_queue_size=64).start()
    yield s
    s.stop()


def test_both_models_listed_and_routed(server, llama_dir):
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in data] == [llama_dir.name, "couplets"]
    assert [m["couplets"] for m in data] == [False, True]
    plain = httpx.post(server.url + "/generate", json={"prompt": "春回大地", "max_tokens": 8, "temperature": 0})
    routed = httpx.post(server.url + "/generate", json={"prompt": "春回大地", "model": "couplets", "temperature": 0,
                                                        "max_tokens": 8})
    assert plain.status_code == routed.status_code == 200
    assert plain.json()["model"] == llama_dir.name and routed.json()["model"] == "couplets"
    # the couplet model answers a raw 上联 with Chinese; the tiny Llama does not know those characters
    assert rules.hanzi(routed.json()["text"]) and routed.json()["text"] != plain.json()["text"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "model": "nope", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "couplets" in r.json()["error"]["message"]


def test_couplet_endpoint(server):
    r = httpx.post(server.url + "/couplet", json={"keywords": "马年 吉祥", "seed": 3}, timeout=60)
    body = r.json()
    assert r.status_code == 200 and body["model"] == "couplets", body
    up, low, hor = body["upper"], body["lower"], body["horizontal"]
    assert len(up) == len(low) >= 5 and len(hor) == 4 and body["keywords"] == ["马年", "吉祥"]
    assert body["rules"] == rules.check(up, low, hor, ["马年", "吉祥"]) and body["timing"]["seconds"] > 0
    again = httpx.post(server.url + "/couplet", json={"keywords": "马年，吉祥", "seed": 3}, timeout=60).json()
    assert (again["upper"], again["lower"], again["horizontal"]) == (up, low, hor)      # same seed, same couplet
    # the deployment guide's shape
    g = httpx.post(server.url + "/generate", json={"keywords": "马年 吉祥", "seed": 3}, timeout=60).json()
    assert g["couplet"] == f"上联：{up}\n下联：{low}\n横批：{hor}"
    free = httpx.post(server.url + "/couplet", json={"keywords": "春", "method": "free", "seed": 1}, timeout=60)
    assert free.status_code == 200 and free.json()["constrained"] is False


@pytest.mark.parametrize("body,param", [
    ({"keywords": ""}, "keywords"), ({"keywords": "<script>"}, "keywords"), ({"keywords": "春 夏 秋 冬 东 南 西 北 中"}, "keywords"),
    ({"keywords": "春", "method": "magic"}, "method"), ({"keywords": "春", "num_candidates": 0}, "num_candidates"),
    ({"keywords": "春", "seed": -1}, "seed"), ({"keywords": 5}, "keywords"), ({"keyword": "春"}, "keywords"),
    ({"keywords": "春夏秋冬东南西北 中发白红黄蓝绿紫 金"}, "keywords"), ({"keywords": "新年" * 101}, "keywords"),
    ({"keywords": "hello world"}, "keywords"), ({"keywords": "<b>春</b>"}, "keywords"),
])
def test_bad_couplet_requests_are_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/couplet", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["message"]                   # a sentence the page shows as is
    assert httpx.get(server.url + "/ready").status_code == 200          # and the server still answers


def test_couplet_on_a_model_that_cannot_write_them(server, llama_dir):
    r = httpx.post(server.url + "/couplet", json={"keywords": "春", "model": llama_dir.name})
    assert r.status_code == 400 and r.json()["error"]["code"] == "not_a_couplet_model"
    r = httpx.post(server.url + "/generate", json={"keywords": "春", "prompt": "x"})
    assert r.status_code == 400


def test_page_is_served_and_locked_down(server):
    r = httpx.get(server.url + "/couplet")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "开门见喜" in r.text and "default-src 'self'" in r.headers["content-security-policy"]


def test_metrics_carry_both_models_once_per_family(server, llama_dir):
    text = httpx.get(server.url + "/metrics").text
    helps = re.findall(r"^# HELP (\S+)", text, re.M)
    assert len(helps) == len(set(helps))
    running = re.findall(r'^leapfrog:num_requests_running\{model_name="([^"]+)"\}', text, re.M)
    assert sorted(running) == sorted([llama_dir.name, "couplets"])


def test_couplet_load_bench(server, tmp_path):
    """`leapfrog bench --serve --couplet`: every couplet done or shed, none failed, the server's
    own time and its memory reported."""
    import json

    from leapfrog.bench.cli import main as bench_main
    rc = bench_main(["--serve", "--couplet", "--url", server.url, "--concurrency", "2", "--num-prompts", "4",
                     "--out", str(tmp_path), "--name", "c"])
    lv = json.loads((tmp_path / "c.json").read_text())["levels"][0]
    assert rc == 0 and lv["failed"] == 0 and lv["completed"] + lv["shed"] == 4 and lv["completed"] >= 1
    assert 0 < lv["server_s"]["p50"] <= lv["e2e_s"]["p99"] and lv["server_peak_rss_bytes"] > 0
    assert "server-side p50 / p99" in (tmp_path / "c.md").read_text()


def test_couplets_past_capacity_are_shed_with_a_retry_after(server):
    """At max_couplets_in_flight a couplet is a 429 queue_full with Retry-After (1 s by default,
    RetryAdvice's with couplet_retry_after 0), and nothing else changes: once places free up the
    same request is written."""
    writer = server.state.couplet_server("couplets")
    cap = server.state.cfg.max_couplets_in_flight
    writer.couplets_in_flight += cap
    try:
        r = httpx.post(server.url + "/couplet", json={"keywords": "春 福"}, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert int(r.headers["Retry-After"]) >= 1 and f"retry in {r.headers['Retry-After']} s" in r.json()["error"]["message"]
        assert r.headers["Retry-After"] == str(server.state.cfg.couplet_retry_after) == "1"   # the default
        server.state.cfg.couplet_retry_after = 0                                              # adaptive
        r = httpx.post(server.url + "/couplet", json={"keywords": "春 福"}, timeout=30)
        assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 30
    finally:
        writer.couplets_in_flight -= cap
        server.state.cfg.couplet_retry_after = 1
    assert httpx.post(server.url + "/couplet", json={"keywords": "春 福"}, timeout=60).status_code == 200


def test_retry_advice_brings_shed_clients_back_as_fast_as_places_free_up():
    """A simulated crowd: 200 clients turned away, each coming back after the advised Retry-After,
    places freeing at 10 a second. The advice grows from 1 s towards W / C = 20 s (within [1, 30]),
    which cuts the sheds from 200 a second (a fixed 1 s) to a few tens, and falls back to 1 s
    once the crowd is gone."""
    import statistics

    from leapfrog.serve.backoff import RetryAdvice
    now = [0.0]
    advice = RetryAdvice(clock=lambda: now[0])
    waiting, capacity_per_s = 200, 10
    next_try = [0.0] * waiting
    late_sheds, late_advice = 0, []
    for tick in range(600):                      # 60 s in steps of 0.1 s
        now[0] = tick / 10
        if tick % 10 == 0:
            for _ in range(capacity_per_s):      # places freeing up (taken by others)
                advice.finished()
        for i in range(waiting):
            if next_try[i] <= now[0]:
                wait = advice.shed()
                next_try[i] = now[0] + wait
                if now[0] >= 40:
                    late_sheds += 1
                    late_advice.append(wait)
    assert all(1 <= w <= 30 for w in late_advice) and statistics.median(late_advice) >= 8
    assert late_sheds / 20 < 0.25 * waiting       # sheds a second over the last 20 s
    for tick in range(600, 1050):                # the crowd is gone (for longer than the longest wait)
        now[0] = tick / 10
        advice.finished()
    assert advice.current() == 1
