"""Helpers for the server tests: the real app under uvicorn on a free local port, in a thread."""
from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import socket
import ssl
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from leapfrog.serve.main import DrainingServer, create_app
from leapfrog.serve.config import build_config
from leapfrog.serve.connections import http_protocol


def post(server, path: str, body, **kw) -> httpx.Response:
    """A JSON POST to a running ServerThread."""
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


BROWSER = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome",
                                               "google-chrome-stable"))), None)


def chromium():
    """A headless system Chromium under Playwright (its own browser download is not needed), for
    a module-scoped fixture to `yield from`; skips when Playwright or a Chromium is missing."""
    import pytest
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
    if BROWSER is None:
        pytest.skip("no Chromium found (chromium, chromium-browser or google-chrome on PATH)")
    pw = sync_api.sync_playwright().start()
    try:
        b = pw.chromium.launch(executable_path=BROWSER, headless=True)
    except Exception as e:
        pw.stop()
        pytest.fail(f"{BROWSER} is there but Playwright could not start it: {e}")
    yield b
    b.close()
    pw.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """`leapfrog serve` in-process: same app, same uvicorn, no subprocess start-up cost."""

    def __init__(self, model_dir: Path, **options: object) -> None:
        flags = {"model": str(model_dir), "host": "127.0.0.1", "port": free_port(), "warmup_requests": 1,
                 "max_batch_size": 8, "served_model_name": "tiny", "log_level": "warning",
                 "shutdown_timeout": 10.0, "batch_dir": tempfile.mkdtemp(prefix="leapfrog-batches-"), **options}
        self.cfg = build_config(flags, environ={})
        self.app = create_app(self.cfg)
        self.state = self.app.state.leapfrog
        self.server = DrainingServer(uvicorn.Config(
            self.app, host="127.0.0.1", port=self.cfg.port, log_level="warning", timeout_graceful_shutdown=10,
            ssl_certfile=self.cfg.ssl_certfile, ssl_keyfile=self.cfg.ssl_keyfile,
            http=http_protocol(self.cfg.header_timeout)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        scheme = "https" if self.cfg.ssl_certfile else "http"
        self.url = f"{scheme}://127.0.0.1:{self.cfg.port}"
        self.verify = ssl.create_default_context(cafile=self.cfg.ssl_certfile) if self.cfg.ssl_certfile else True

    def start(self, timeout: float = 180.0) -> "ServerThread":   # a loaded CI machine is slow
        self.thread.start()
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/ready", timeout=1, verify=self.verify).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not become ready")

    def stop(self) -> None:
        self.server.handle_exit(15, None)
        self.thread.join(timeout=30)

    def metric(self, name: str) -> float:
        """Value of one unlabelled-but-model_name series from /metrics."""
        text = httpx.get(self.url + "/metrics").text
        m = re.search(rf"^leapfrog:{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        assert m, f"{name} not in /metrics"
        return float(m.group(1))

    def wait_idle(self, timeout: float = 5.0) -> float:
        """Waits until no KV blocks are in use; returns the last seen count."""
        deadline = time.time() + timeout
        used = -1.0
        while time.time() < deadline:
            used = self.metric("kv_cache_used_blocks")
            if used == 0 and self.metric("num_requests_running") == 0:
                return 0.0
            time.sleep(0.05)
        return used


def wait_ready(proc, url: str, timeout: float = 180.0) -> None:
    """Waits for a `leapfrog serve` subprocess to answer /ready with 200 (a loaded CI machine
    starts slowly); fails with its stderr if it exits first."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError(proc.stderr.read() if proc.poll() is not None else "server not ready in time")


def assert_error(resp: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def still_works(url: str, headers: dict | None = None) -> None:
    r = httpx.post(url + "/generate", json={"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0},
                   headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["num_tokens"] >= 1


def pace_engine(monkeypatch, seconds: float = 0.005) -> None:
    """Slow every engine step down (tests whose subject is a request still running when
    something happens; on its own the tiny test model decodes 240 tokens in a few ms). A step
    of a lone request decodes up to num_scheduler_steps (16) tokens on a CPU."""
    from leapfrog.engine.llm_engine import LLMEngine
    real_step = LLMEngine.step
    monkeypatch.setattr(LLMEngine, "step", lambda self: time.sleep(seconds) or real_step(self))


def on_loop(server, fn, *args):
    """Runs fn(*args) on the server's event loop (where the couplet line lives) and returns its result."""
    async def call():
        return fn(*args)
    return asyncio.run_coroutine_threadsafe(call(), server.state.engine._loop).result(10)


def wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition not reached in time"
        time.sleep(0.02)


@contextlib.contextmanager
def couplet_places_taken(server, rate: float = 1.0):
    """Every place of the couplet line taken by holders the test releases (tickets joined on the
    server's loop), the line's drain rate set to `rate` couplets a second; all put back after."""
    from leapfrog.serve.line import DrainRate
    from leapfrog.serve.couplet import couplet_server, desk
    line = desk(couplet_server(server.state, "couplets")).line
    saved = line.drain, line.max_wait_s
    line.drain = DrainRate(prior=rate)
    holders = [on_loop(server, line.join) for _ in range(line.places)]
    assert line.in_use == line.places and line.num_waiting == 0
    try:
        yield line, holders
    finally:
        for t in holders:
            on_loop(server, line.release, t)
        wait_until(lambda: line.in_use == 0 and line.num_waiting == 0)
        line.drain, line.max_wait_s = saved
