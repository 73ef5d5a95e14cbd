"""Faults, each with the error it must give and a check that service goes on: the engine loop
dying (restarted within 10 s, its requests failed explicitly), a loop that keeps failing, clients
that hang up at any point, checkpoint files changed on disk under a running server, and a
burst of ten times the server's capacity."""
from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest

from test_server_common import ServerThread, assert_error, pace_engine, still_works

RECOVERY_LIMIT_S = 10.0


class InjectedCrash(BaseException):
    """Escapes `except Exception`: what kills a thread (as a C extension's SystemExit or a
    KeyboardInterrupt delivered to the wrong thread would)."""


@pytest.fixture(scope="module")
def server(llama_dir):
    s = ServerThread(llama_dir, max_batch_size=8, max_queue_size=16).start()
    yield s
    s.stop()


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    kw.setdefault("timeout", 60)
    return httpx.post(server.url + path, json=body, **kw)


def wait_ready(server, timeout: float = RECOVERY_LIMIT_S) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if httpx.get(server.url + "/ready").status_code == 200:
            return time.perf_counter() - t0
        time.sleep(0.02)
    raise AssertionError("the server did not become ready again")


def crash_after(server, steps: int, exc: BaseException) -> None:
    """The engine loop's `step` raises `exc` after `steps` good steps (this engine only; the
    rebuilt engine steps normally)."""
    engine = server.state.engine.engine
    real = engine.step
    count = [0]

    def step():
        count[0] += 1
        if count[0] > steps:
            raise exc
        return real()
    engine.step = step


def test_engine_loop_death_fails_in_flight_and_restarts(server, monkeypatch):
    pace_engine(monkeypatch, 0.02)
    restarts = server.metric("engine_restarts_total")
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    results: dict = {}
    streamed: list = []

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            streamed.extend(json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {"))
    threads = [threading.Thread(target=lambda: results.update(plain=post(server, "/v1/completions", body))),
               threading.Thread(target=stream)]
    crash_after(server, 4, InjectedCrash("injected: the engine loop dies"))    # both are decoding by then
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a request in flight hung when the engine died"
    err = assert_error(results["plain"], 500)
    assert "restarting" in err["message"] and "injected" in err["message"]
    assert "error" in streamed[-1] and "restarting" in streamed[-1]["error"]["message"]
    # health reports it while the engine is rebuilt (or already the recovery), then ready again
    health = httpx.get(server.url + "/health").json()
    assert health["status"] in ("restarting", "healthy")
    recovered = wait_ready(server)
    engine = server.state.engine
    assert engine.last_recovery_s is not None and engine.last_recovery_s < RECOVERY_LIMIT_S
    assert recovered < RECOVERY_LIMIT_S
    assert server.metric("engine_restarts_total") == restarts + 1
    assert httpx.get(server.url + "/health").json()["status"] == "healthy"
    assert httpx.get(server.url + "/healthz").status_code == 200
    assert server.wait_idle() == 0
    still_works(server.url)


def test_requests_during_a_restart_get_503_with_retry_after(server, monkeypatch):
    engine = server.state.engine
    real = engine._factory

    def slow_factory():
        time.sleep(1.0)
        return real()
    monkeypatch.setattr(engine, "_factory", slow_factory)
    crash_after(server, 0, InjectedCrash("injected"))
    r = post(server, "/generate", {"prompt": "Once", "max_tokens": 4})   # this one meets the dying loop
    assert r.status_code in (500, 503), r.text
    deadline = time.time() + 5
    while httpx.get(server.url + "/ready").json()["status"] != "restarting" and time.time() < deadline:
        time.sleep(0.01)
    assert httpx.get(server.url + "/ready").json() == {"status": "restarting"}
    r = post(server, "/generate", {"prompt": "Once", "max_tokens": 4})
    err = assert_error(r, 503, "not_ready")
    assert "restarting" in err["message"] and r.headers["retry-after"]
    assert httpx.get(server.url + "/healthz").status_code == 200      # recovering, not dead
    wait_ready(server)
    still_works(server.url)


def test_a_loop_that_keeps_failing_is_rebuilt(server):
    """Errors inside the loop's bookkeeping are logged and survived; the same error three
    times in a row counts as the loop dying."""
    restarts = server.metric("engine_restarts_total")
    engine = server.state.engine.engine

    def broken() -> bool:
        raise RuntimeError("injected: bookkeeping fails every time")
    engine.has_unfinished = broken
    r = post(server, "/generate", {"prompt": "Once", "max_tokens": 4})
    assert r.status_code in (200, 500, 503), r.text
    wait_ready(server)
    assert server.metric("engine_restarts_total") == restarts + 1
    still_works(server.url)


# --- clients that hang up --------------------------------------------------------------------------
@pytest.mark.parametrize("after_events", [0, 1, 5])
def test_stream_hung_up_at_any_point_frees_everything(server, monkeypatch, after_events):
    pace_engine(monkeypatch)
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True, "n": 2}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if seen >= after_events:
                break
            seen += bool(line)
    assert server.wait_idle(5) == 0
    still_works(server.url)


def test_non_streaming_client_hung_up_mid_decode_frees_everything(server, monkeypatch):
    pace_engine(monkeypatch, 0.05)
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                                              "ignore_eos": True}, timeout=0.2)
    assert server.wait_idle(5) == 0
    still_works(server.url)


def test_couplet_client_hung_up_frees_everything(monkeypatch):
    s = ServerThread("couplets", served_model_name=None).start()
    pace_engine(monkeypatch, 0.01)       # a warmed-up couplet can take less than the first timeout
    try:
        for timeout in (0.02, 0.1):      # during the first round, and later
            with pytest.raises(httpx.ReadTimeout):
                post(s, "/couplet", {"keywords": "马年 吉祥", "num_candidates": 16}, timeout=timeout)
            assert s.wait_idle(10) == 0
        from leapfrog.serve.couplet import desk
        line = desk(s.state.primary).line
        assert line.in_use == 0 and line.num_waiting == 0
        assert post(s, "/couplet", {"keywords": "春"}).status_code == 200
    finally:
        s.stop()


# --- the checkpoint folder under a running server -----------------------------------------------------
def test_checkpoint_files_changed_on_disk_do_not_corrupt_a_running_server(llama_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(llama_dir, folder)
    s = ServerThread(folder, max_batch_size=4).start()
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        want = post(s, "/generate", body).json()["text"]
        (folder / "model.safetensors").write_bytes(b"\0" * 64)           # truncated and zeroed in place
        (folder / "tokenizer.json").write_text("{ not json")
        (folder / "config.json").unlink()
        assert post(s, "/generate", body).json()["text"] == want
        assert httpx.get(s.url + "/ready").status_code == 200
    finally:
        s.stop()


# --- fault injection, for drills and the reliability benchmark --------------------------------------
def test_fault_injection_endpoint_is_off_by_default(server):
    r = post(server, "/admin/fault", {"fault": "engine_crash"})
    assert_error(r, 404)
    assert "/admin/fault" not in httpx.get(server.url + "/openapi.json").json()["paths"]


def test_injected_engine_crash_recovers(llama_dir):
    s = ServerThread(llama_dir, fault_injection=True, max_batch_size=4).start()
    try:
        assert_error(post(s, "/admin/fault", {"fault": "disk_full"}), 400, param="fault")
        assert_error(post(s, "/admin/fault", {"fault": "engine_crash", "model": "nope"}), 404)
        t0 = time.perf_counter()
        r = post(s, "/admin/fault", {"fault": "engine_crash"})
        assert r.status_code == 202 and r.json() == {"fault": "engine_crash", "model": "tiny"}
        deadline = time.time() + 5
        while s.state.engine.restarts == 0 and time.time() < deadline:
            time.sleep(0.01)
        wait_ready(s)
        assert time.perf_counter() - t0 < RECOVERY_LIMIT_S and s.metric("engine_restarts_total") == 1
        still_works(s.url)
        assert "/admin/fault" in httpx.get(s.url + "/openapi.json").json()["paths"]
    finally:
        s.stop()
