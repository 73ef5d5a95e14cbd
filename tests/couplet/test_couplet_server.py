"""Two models behind one server (a tiny Llama first, the built-in `couplets` second): routing
by `model`, /v1/models, one /metrics with both, and the couplet endpoints and page."""
from __future__ import annotations

import re

import httpx
import pytest

from leapfrog.couplet import rules
from test_server_common import ServerThread, couplet_places_taken, on_loop, wait_until


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


def test_chat_with_the_couplet_model_answers_the_upper_line_with_its_lower_line(server):
    """The couplets checkpoint's chat template renders the last user turn as the pair-mode prompt,
    so chat and completions give the same 下联 (the character vocabulary cannot spell 'user:')."""
    up = "春风送暖入屠苏"
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "couplets", "messages": [{"role": "system", "content": "写下联"}, {"role": "user", "content": up}]})
    plain = httpx.post(server.url + "/v1/completions", json={"model": "couplets", "prompt": up}, timeout=60)
    assert chat.status_code == plain.status_code == 200, chat.text
    reply = chat.json()["choices"][0]["message"]["content"]
    assert reply == plain.json()["choices"][0]["text"] and len(rules.hanzi(reply)) == len(up)
    assert chat.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"] == len(up) + 2


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
    escaped = httpx.post(server.url + "/generate", content='{"key\\u0077ords": "马年 吉祥", "seed": 3}'.encode(),
                         headers={"content-type": "application/json"}, timeout=60)    # the same key, escaped
    assert escaped.status_code == 200 and escaped.json()["couplet"] == g["couplet"], escaped.text
    free = httpx.post(server.url + "/couplet", json={"keywords": "春", "method": "free", "seed": 1}, timeout=60)
    assert free.status_code == 200 and free.json()["constrained"] is False


@pytest.mark.parametrize("body,param", [
    ({"keywords": ""}, "keywords"), ({"keywords": "<script>"}, "keywords"), ({"keywords": "春 夏 秋 冬 东 南 西 北 中"}, "keywords"),
    ({"keywords": "春", "method": "magic"}, "method"), ({"keywords": "春", "num_candidates": 0}, "num_candidates"),
    ({"keywords": "春", "seed": -1}, "seed"), ({"keywords": 5}, "keywords"), ({"keyword": "春"}, "keywords"),
    ({"keywords": "春夏秋冬东南西北 中发白红黄蓝绿紫 金"}, "keywords"), ({"keywords": "新年" * 101}, "keywords"),
    ({"keywords": "hello world"}, "keywords"), ({"keywords": "<b>春</b>"}, "keywords"),
    ({"keywords": "春", "method": "free", "num_candidates": 4}, "num_candidates"),   # once ignored silently
])
def test_bad_couplet_requests_are_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/couplet", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["message"]                   # a sentence the page shows as is
    assert httpx.get(server.url + "/ready").status_code == 200          # and the server still answers


def test_a_small_server_writes_couplets_with_the_candidates_it_holds():
    """A server that holds fewer generations at once than a couplet's candidates: the default
    count fits what it holds, and a num_candidates it can never hold is a 400 naming that field."""
    s = ServerThread("couplets", max_batch_size=1, max_queue_size=0).start()
    try:
        r = httpx.post(s.url + "/couplet", json={"keywords": "马年 吉祥", "seed": 1}, timeout=120)
        assert r.status_code == 200 and r.json()["upper"] and r.json()["lower"], r.text
        r = httpx.post(s.url + "/couplet", json={"keywords": "马年 吉祥", "num_candidates": 4}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "num_candidates", r.text
    finally:
        s.stop()


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


@pytest.fixture
def full_house(server):
    with couplet_places_taken(server) as taken:
        yield taken


def test_couplets_wait_in_line_first_come_first_served_then_past_the_bound_get_429(server, full_house):
    """With every place taken, couplets wait in line in the order they came while their expected
    wait (place over the drain rate) fits max_couplet_wait_s; the next is a 429 whose Retry-After
    is when its place would be half the bound from the front, and nothing else changes. Freed
    places go to the line in order."""
    import threading
    line, holders = full_house
    line.max_wait_s = 2.5                                  # 1 s and 2 s fit; the third would wait 3 s
    done: list[int] = []
    results: dict[int, httpx.Response] = {}

    def press(k: int) -> None:
        results[k] = httpx.post(server.url + "/couplet", json={"keywords": "春 福", "seed": k}, timeout=60)
        done.append(k)
    threads = []
    for k in range(2):
        threads.append(threading.Thread(target=press, args=(k,)))
        threads[-1].start()
        wait_until(lambda: line.num_waiting == k + 1)      # in line, in this order
    r = httpx.post(server.url + "/couplet", json={"keywords": "春 福"}, timeout=30)
    err = r.json()["error"]
    # it would wait 3 s; told to come back when it would be half the bound from the front: 1.75 s
    assert r.status_code == 429 and err["code"] == "queue_full" and r.headers["Retry-After"] == "2"
    assert "max_couplet_wait_s" in err["message"] and "3 s" in err["message"] and "retry in 2 s" in err["message"]
    assert line.num_waiting == 2 and not done             # the ones waiting are unharmed
    on_loop(server, line.release, holders.pop())          # one place frees: the first in line gets it
    wait_until(lambda: done == [0])                       # (its place then goes to the second)
    wait_until(lambda: done == [0, 1])
    for t in threads:
        t.join()
    for k in range(2):
        body = results[k].json()
        assert results[k].status_code == 200 and len(body["upper"]) == len(body["lower"]) >= 5
        assert body["timing"]["waited_s"] > 0


def test_a_client_that_leaves_the_line_leaves_it_at_once(server, full_house):
    line, _ = full_house
    before = rejected(server, "left_line")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/couplet", json={"keywords": "春 福"}, timeout=httpx.Timeout(30, read=0.5))
    wait_until(lambda: line.num_waiting == 0, timeout=0.5)    # gone with the connection, no polling delay
    wait_until(lambda: rejected(server, "left_line") == before + 1)


def rejected(server, reason: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf'^leapfrog:http_requests_rejected_total{{[^}}]*reason="{reason}"[^}}]*}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_streamed_couplet_reports_its_place_in_line_then_the_couplet(server, full_house):
    """`stream: true`: server-sent events `queued` (place, expected wait) while waiting, `writing`,
    then `couplet` with the same body a plain request gets."""
    import json
    import threading
    line, holders = full_house
    events: list[tuple[str, dict]] = []

    def listen() -> None:
        with httpx.stream("POST", server.url + "/couplet", json={"keywords": "马年 吉祥", "seed": 3, "stream": True},
                          timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            name = None
            for row in r.iter_lines():
                if row.startswith("event: "):
                    name = row[7:]
                elif row.startswith("data: "):
                    events.append((name, json.loads(row[6:])))
    t = threading.Thread(target=listen)
    t.start()
    wait_until(lambda: events)
    assert events[0] == ("queued", {"position": 1, "expected_wait_s": 1.0})
    on_loop(server, line.release, holders.pop())
    t.join(60)
    names = [n for n, _ in events]
    assert names[-2:] == ["writing", "couplet"] and set(names[:-2]) == {"queued"}, names
    plain = httpx.post(server.url + "/couplet", json={"keywords": "马年 吉祥", "seed": 3}, timeout=60).json()
    streamed = events[-1][1]
    assert (streamed["upper"], streamed["lower"], streamed["horizontal"]) == (plain["upper"], plain["lower"],
                                                                              plain["horizontal"])


def test_the_couplet_rate_is_timed_before_ready(server):
    """Warm-up writes a full house of couplets at once, so the first crowd already has an estimate."""
    from leapfrog.serve.couplet import couplet_server, desk
    line = desk(couplet_server(server.state, "couplets")).line
    assert line.drain.prior is not None and line.drain.prior > 0


def test_couplet_crowd_bench(server, tmp_path):
    """`leapfrog bench --serve --couplet`: a crowd presses at once against a server with every
    place taken and no room in line, so each person first gets 429s and comes back by itself as
    the page does; once places free up everyone gets a couplet. The report counts the 429s, the
    share served, the time from the press, the order kept and /healthz's slowest answer."""
    import json
    import threading

    from leapfrog.bench.cli import main as bench_main
    shed_before = rejected(server, "queue_full")
    rc = {}
    with couplet_places_taken(server) as (line, holders):
        line.max_wait_s = 0.0
        t = threading.Thread(target=lambda: rc.update(rc=bench_main([
            "--serve", "--couplet", "--url", server.url, "--concurrency", "3", "--warmup", "0",
            "--out", str(tmp_path), "--name", "c"])))
        t.start()
        wait_until(lambda: rejected(server, "queue_full") >= shed_before + 3)     # each was turned away
    t.join(120)
    lv = json.loads((tmp_path / "c.json").read_text())["levels"][0]
    assert rc["rc"] == 0 and lv["people"] == 3 and lv["completed"] == 3 and lv["served_share"] == 1.0
    assert lv["failed"] == lv["gave_up"] == 0 and lv["shed"] >= 3
    assert lv["e2e_s"]["p99"] >= 1.0 > lv["server_s"]["p50"] > 0            # the retry waited Retry-After
    assert 0 <= lv["overtaken"] <= 1 and 0 < lv["healthz_s"]["max"] < 5 and lv["server_peak_rss_bytes"] > 0
    assert "press to couplet" in (tmp_path / "c.md").read_text() and (tmp_path / "c.png").stat().st_size > 0


def test_served_out_of_turn():
    from leapfrog.bench.serve import overtaken
    assert overtaken([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]) == 0.0                 # in order
    assert overtaken([(0.0, 1.0), (0.1, 0.5)]) == 0.0                            # a burst: no order within it
    assert overtaken([(0.0, 5.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0)]) == 0.25   # the first waited for three later
    assert overtaken([(0.0, 9.0), (1.0, 8.0), (2.0, 7.0)]) == pytest.approx(2 / 3)
