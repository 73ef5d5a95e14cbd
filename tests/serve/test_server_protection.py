"""Bad input and abuse: each case asserts the status, the OpenAI error body, and that the
server still answers correctly afterwards."""
from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time

import httpx
import openai
import pytest

from leapfrog.serve.config import ConfigError, build_config
from leapfrog.serve.auth import jwt_encode
from test_server_common import ServerThread, assert_error, pace_engine, still_works


@pytest.fixture(scope="module")
def server(llama_dir):
    s = ServerThread(llama_dir).start()
    yield s
    s.stop()


def post(server, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, **kw)
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


@pytest.mark.parametrize("path,body,status,code,param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "invalid_type", "max_tokens"),
    ("/v1/completions", {"prompt": 42}, 400, "invalid_type", "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "invalid_type", "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_token": 5}, 400, "unknown_field", "max_token"),
    ("/v1/completions", {"max_tokens": 5}, 400, "missing_field", "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "invalid_value", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, 400, "invalid_value", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, 400, "context_length_exceeded", "max_tokens"),
    ("/v1/completions", {"prompt": "cat " * 400}, 400, "context_length_exceeded", "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "invalid_token_id", "prompt"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "invalid_value", "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 9}, 400, "invalid_value", "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, 400, "invalid_value", "n"),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "invalid_value", "best_of"),
    ("/v1/completions", {"prompt": "hi", "best_of": 4}, 400, "unsupported", "best_of"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-5"}, 404, "model_not_found", "model"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "invalid_type", "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "empty_prompt", "messages"),
    ("/generate", {"prompt": "hi", "max_tokens": 3, "max_length": 4}, 400, None, "max_length"),
    ("/generate", {"prompt": ""}, 400, "empty_prompt", "prompt"),
])
def test_bad_input(server, path, body, status, code, param):
    assert_error(post(server, path, body), status, code, param)
    still_works(server.url)


def test_malformed_json(server):
    assert_error(post(server, "/v1/completions", b"{not json"), 400)
    assert_error(post(server, "/generate", b"[1, 2]"), 400)
    assert_error(post(server, "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), 400)
    still_works(server.url)


def test_unknown_route_and_method(server):
    assert_error(httpx.get(server.url + "/v1/nothing"), 404, "not_found")
    assert_error(httpx.get(server.url + "/generate"), 405)
    still_works(server.url)


def test_openai_client_sees_errors(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    still_works(server.url)


def test_client_gone_while_waiting_frees_blocks(server, monkeypatch):
    """A non-streaming client that times out is noticed and its request aborted."""
    pace_engine(monkeypatch)
    with pytest.raises(httpx.ReadTimeout):
        # Four 240-token completions at >= 5 ms a step take over a second, against 50 ms.
        httpx.post(server.url + "/v1/completions",
                   json={"prompt": "Once", "max_tokens": 240, "ignore_eos": True, "n": 4}, timeout=0.05)
    assert server.wait_idle(timeout=5) == 0
    still_works(server.url)


def _long_stream(url: str, started: threading.Event, results: list, max_tokens: int = 120,
                 quit: threading.Event | None = None) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = []
        for line in r.iter_lines():
            started.set()
            if line:
                lines.append(line)
            if quit is not None and quit.is_set():
                break             # hang up mid-stream
        results.append((r.status_code, lines))


def test_queue_full_answers_429(llama_dir, monkeypatch):
    # The two long streams must still be running and queued when the third request arrives.
    pace_engine(monkeypatch)
    s = ServerThread(llama_dir, max_batch_size=1, max_queue_size=1).start()
    try:
        results: list = []
        quit = threading.Event()
        threads = [threading.Thread(target=_long_stream, args=(s.url, threading.Event(), results, 240, quit))
                   for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.time() + 10
        while s.state.engine.num_in_flight < 2 and time.time() < deadline:
            time.sleep(0.01)
        assert s.state.engine.num_in_flight == 2      # one running (batch of 1), one queued
        r = post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert_error(r, 429, "queue_full")
        assert int(r.headers["retry-after"]) >= 1
        quit.set()
        for t in threads:
            t.join(60)
        assert [code for code, _ in results] == [200, 200]
        assert s.wait_idle() == 0
        still_works(s.url)
    finally:
        s.stop()


def test_auth_and_rate_limit(llama_dir, tmp_path):
    keyfile = tmp_path / "keys.txt"
    keyfile.write_text("# one key per line\nkey-two\n")
    s = ServerThread(llama_dir, api_key=["key-one"], api_key_file=str(keyfile), jwt_secret="s3cret",
                     rate_limit=0.2, rate_limit_burst=2).start()
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        assert_error(post(s, "/v1/completions", body), 401, "invalid_api_key")
        assert_error(post(s, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
        assert post(s, "/v1/completions", body, headers={"Authorization": "Bearer key-one"}).status_code == 200
        # JWT: valid, expired, forged
        good = jwt_encode({"sub": "alice", "exp": time.time() + 60}, "s3cret")
        old = jwt_encode({"sub": "alice", "exp": time.time() - 3600}, "s3cret")
        forged = jwt_encode({"sub": "alice"}, "not-the-secret")
        assert post(s, "/generate", body, headers={"Authorization": f"Bearer {good}"}).status_code == 200
        err = assert_error(post(s, "/generate", body, headers={"Authorization": f"Bearer {old}"}), 401)
        assert "expired" in err["message"]
        err = assert_error(post(s, "/generate", body, headers={"Authorization": f"Bearer {forged}"}), 401)
        assert "signature" in err["message"] and forged not in err["message"]
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        # the orchestrator's probes stay open (a status word only); everything else needs the key
        for path in ("/healthz", "/ready"):
            assert httpx.get(s.url + path).status_code == 200
            assert set(httpx.get(s.url + path).json()) == {"status"}
        # the chat page opens without one (static HTML; its key box sends the key with its requests)
        page = httpx.get(s.url + "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert_error(httpx.post(s.url + "/", json={}), 401, "invalid_api_key")
        for path in ("/health", "/metrics", "/docs", "/openapi.json", "/v1/models"):
            assert_error(httpx.get(s.url + path), 401, "invalid_api_key")
            assert httpx.get(s.url + path, headers={"Authorization": "Bearer key-one"}).status_code == 200
        # rate limit: key-two gets a burst of 2, then 429; key-one has its own bucket
        two = {"Authorization": "Bearer key-two"}
        assert [post(s, "/generate", body, headers=two).status_code for _ in range(2)] == [200, 200]
        r = post(s, "/generate", body, headers=two)
        assert_error(r, 429, "rate_limit_exceeded")
        assert int(r.headers["retry-after"]) >= 1
        still_works(s.url, headers={"Authorization": "Bearer key-one"})
    finally:
        s.stop()


def test_request_timeout(llama_dir, monkeypatch):
    pace_engine(monkeypatch)
    s = ServerThread(llama_dir, request_timeout=0.05).start()
    try:   # four 240-token completions at >= 5 ms a step cannot finish in 50 ms
        r = post(s, "/v1/completions", {"prompt": "Once", "max_tokens": 240, "ignore_eos": True, "n": 4})
        assert_error(r, 504, "request_timeout")
        assert s.wait_idle() == 0
        assert 'finished_reason="timeout"' in httpx.get(s.url + "/metrics").text
        still_works(s.url)
    finally:
        s.stop()


def test_graceful_shutdown_finishes_in_flight(llama_dir):
    s = ServerThread(llama_dir).start()
    started, results = threading.Event(), []
    t = threading.Thread(target=_long_stream, args=(s.url, started, results))
    t.start()
    assert started.wait(10)
    s.stop()                      # what SIGTERM does
    t.join(30)
    code, lines = results[0]
    assert code == 200 and lines[-1] == "data: [DONE]"
    assert not any('"error"' in ln for ln in lines)
    chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"   # all 120 tokens


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(llama_dir, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    s = ServerThread(llama_dir, ssl_certfile=str(cert), ssl_keyfile=str(key)).start()
    try:
        assert s.url.startswith("https://")
        r = httpx.post(s.url + "/generate", json={"prompt": "hi", "max_tokens": 2}, verify=s.verify)
        assert r.status_code == 200 and r.json()["num_tokens"] == 2
        with pytest.raises(httpx.TransportError):       # plain HTTP is not served
            httpx.get(s.url.replace("https", "http") + "/health", timeout=2)
    finally:
        s.stop()
    # files that exist but hold no certificate and key: a configuration error, before anything loads
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    for c, k in ((bad, bad), (cert, bad), (key, key)):
        with pytest.raises(ConfigError, match="ssl_certfile=.*not a certificate and its private key"):
            build_config({"model": str(llama_dir), "ssl_certfile": str(c), "ssl_keyfile": str(k)}, environ={})


def test_engine_load_failure_stops_server(llama_dir):
    """A model that cannot load is fatal: the server exits rather than answer 503 forever."""
    s = ServerThread(llama_dir, method_options={"no_such_option": 1})
    s.state.engine.on_fatal = lambda: setattr(s.server, "should_exit", True)
    s.thread.start()
    s.thread.join(30)
    assert not s.thread.is_alive()
    assert "no_such_option" in str(s.state.engine.load_error)


def test_serve_cli_subprocess_sigterm(llama_dir):
    """The real `leapfrog serve` process becomes ready, serves, and exits on SIGTERM."""
    import os
    import signal
    import sys
    from test_server_common import free_port, wait_ready
    port = free_port()
    env = {**os.environ, "LEAPFROG_WARMUP_REQUESTS": "1", "LEAPFROG_LOG_LEVEL": "warning"}
    cmd = [sys.executable, "-m", "leapfrog", "serve", "--model", str(llama_dir), "--host", "127.0.0.1",
           "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url)
        still_works(url)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0      # drained, then a clean exit
    finally:
        if proc.poll() is None:
            proc.kill()
