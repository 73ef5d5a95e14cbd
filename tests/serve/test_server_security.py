"""Security defaults: no CORS unless configured, a warning when an open server listens on a
network address, and the limits every request meets."""
from __future__ import annotations

import httpx
import pytest

from leapfrog.serve.main import startup_warnings
from leapfrog.serve.config import build_config
from test_server_common import ServerThread

PAGE = "https://elsewhere.example"


@pytest.fixture(scope="module")
def server(llama_dir):
    s = ServerThread(llama_dir).start()
    yield s
    s.stop()


def preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url + "/v1/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})


def test_no_cors_headers_by_default(server):
    assert "access-control-allow-origin" not in preflight(server.url, PAGE).headers
    r = httpx.post(server.url + "/generate", json={"prompt": "Once", "max_tokens": 2}, headers={"Origin": PAGE})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_for_configured_origins_only(llama_dir):
    s = ServerThread(llama_dir, cors_allow_origins=[PAGE]).start()
    try:
        assert preflight(s.url, PAGE).headers["access-control-allow-origin"] == PAGE
        assert "access-control-allow-origin" not in preflight(s.url, "https://evil.example").headers
        r = httpx.post(s.url + "/generate", json={"prompt": "Once", "max_tokens": 2}, headers={"Origin": PAGE})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
        # the page may read a 429's Retry-After (the browser hides headers not exposed)
        assert "retry-after" in r.headers.get("access-control-expose-headers", "").lower()
    finally:
        s.stop()


@pytest.mark.parametrize("host, keys, warned", [
    ("0.0.0.0", [], True), ("10.1.2.3", [], True), ("::", [], True), ("my-host", [], True),
    ("127.0.0.1", [], False), ("::1", [], False), ("localhost", [], False), ("0.0.0.0", ["k"], False)])
def test_open_server_on_a_network_address_is_warned_about(host, keys, warned):
    cfg = build_config({"host": host, "api_key": keys}, environ={})
    lines = startup_warnings(cfg, bool(keys))
    assert bool(lines) == warned
    if warned:
        assert "no API key" in lines[0] and host in lines[0]


def test_fault_injection_is_warned_about():
    cfg = build_config({"host": "127.0.0.1", "fault_injection": True}, environ={})
    assert any("fault injection" in line for line in startup_warnings(cfg, False))


def test_default_limits_protect_the_server():
    """Every request meets a limit by default: tokens, prompt, n, stop strings, logprobs, body."""
    from leapfrog.sampling_params import MAX_STOP_STRINGS, MAX_TOKENS_LIMIT
    from leapfrog.serve.schema import BOUNDS
    cfg = build_config({}, environ={})
    assert cfg.max_n == 16 and cfg.max_body_bytes == 4 << 20 and cfg.max_queue_size == 256
    assert cfg.request_timeout > 0 and cfg.default_max_tokens == 256
    assert MAX_STOP_STRINGS == 64 and MAX_TOKENS_LIMIT == 1 << 20 and BOUNDS["logprobs"]["maximum"] == 20


def test_every_response_is_counted_by_status(server):
    def count(status: int) -> float:
        import re
        m = re.search(rf'^leapfrog:http_responses_total{{status="{status}"}} (\S+)$',
                      httpx.get(server.url + "/metrics").text, re.M)
        return float(m.group(1)) if m else 0.0
    before = {s: count(s) for s in (200, 400, 404, 405)}
    httpx.post(server.url + "/generate", json={"prompt": "Once", "max_tokens": 2})
    httpx.post(server.url + "/generate", json={"prompt": "Once", "max_tokens": 0})
    httpx.get(server.url + "/nowhere")
    httpx.delete(server.url + "/generate")
    after = {s: count(s) for s in (200, 400, 404, 405)}
    assert after[400] == before[400] + 1 and after[404] == before[404] + 1 and after[405] == before[405] + 1
    assert after[200] >= before[200] + 1        # + the /metrics reads themselves
