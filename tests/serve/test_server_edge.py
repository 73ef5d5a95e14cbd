"""The server's edge, as a hostile but realistic client finds it (issue 54): a client that hangs up
mid-body is not a server error, error messages name the field and the limit without echoing a huge
value back, chat roles and content are checked, stop token ids are range-checked, probes answer
HEAD, and a connection that never finishes its headers is closed."""
from __future__ import annotations

import re
import socket
import time
import types

import httpx
import pytest

from leapfrog.serve.openai_api import Limits, render_chat
from leapfrog.serve.protocol import APIError, ChatRequest
from test_server_common import ServerThread, assert_error, post, still_works


@pytest.fixture(scope="module")
def server(llama_dir):
    s = ServerThread(llama_dir, header_timeout=0.5).start()
    yield s
    s.stop()


def responses(server, status: int) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf'^leapfrog:http_responses_total{{status="{status}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def test_a_client_that_hangs_up_mid_body_is_a_499_not_a_500(server, caplog):
    before_500, before_499 = responses(server, 500), responses(server, 499)
    with connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": \"Once")
        time.sleep(0.2)
    deadline = time.time() + 10
    while responses(server, 499) == before_499 and time.time() < deadline:
        time.sleep(0.05)
    assert responses(server, 499) == before_499 + 1 and responses(server, 500) == before_500
    assert not [r for r in caplog.records if r.exc_info]          # no traceback in the log
    still_works(server.url)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "stop": "x" * 100_000}, "stop"),
    ({"prompt": "hi", "stop": ["s"] * 10_000}, "stop"),
    ({"prompt": "hi", "logit_bias": {str(i % 50): 1.0 for i in range(50)} | {f"{i:05d}": 1.0 for i in range(4096)}},
     "logit_bias"),
    ({"prompt": "hi", "stop_token_ids": [1] * 10_000}, "stop_token_ids"),
    ({"prompt": "hi", "logit_bias": {"9" * 5000: 1.0}}, "logit_bias"),
])
def test_errors_name_the_field_and_the_limit_without_echoing_a_huge_value(server, body, param):
    r = post(server, "/v1/completions", body)
    err = assert_error(r, 400, param=param)
    assert len(r.content) < 1000, len(r.content)
    assert param in err["message"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_stream_options_without_a_stream_are_400(server, path, body):
    """OpenAI's and vLLM's rule: the usage asked for in a stream's last chunk cannot come without one."""
    r = post(server, path, {**body, "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert_error(r, 400, "invalid_value", "stream_options")
    assert post(server, path, {**body, "max_tokens": 2, "stream_options": None}).status_code == 200


def test_stop_token_ids_outside_the_vocabulary_are_400(server):
    vocab = server.state.engine.info.vocab_size
    for ids in ([99_999_999], [vocab]):
        assert_error(post(server, "/v1/completions", {"prompt": "hi", "stop_token_ids": ids}), 400,
                     "invalid_token_id", "stop_token_ids")
    r = post(server, "/v1/completions", {"prompt": "hi", "stop_token_ids": [vocab - 1], "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("messages,param", [
    ([{"role": "alien", "content": "Hi"}], "messages.0.role"),
    ([{"role": "user", "content": "Hi"}, {"role": "", "content": "x"}], "messages.1.role"),
    ([{"role": "user", "content": None}], "messages.0.content"),
    ([{"role": "system", "content": "be brief"}, {"role": "user"}], "messages.1.content"),
    ([{"role": "assistant", "content": None}], "messages.0.content"),
    ([{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "x.png"}}]}],
     "messages.0.content.1.type"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}],
     "messages.0.content.0.type"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content.0.text"),
])
def test_unknown_chat_roles_and_missing_content_are_400(server, messages, param):
    err = assert_error(post(server, "/v1/chat/completions", {"messages": messages}), 400, param=param)
    assert param in err["message"]


def test_text_parts_are_joined_as_openai_sends_them(server):
    """A content list of text parts is the same prompt as its texts joined by newlines, as vLLM and
    llama-server join them (an image part is a 400 above, not dropped without a word)."""
    def reply(content):
        r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                   "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.json()["usage"]["prompt_tokens"]
    assert reply([{"type": "text", "text": "Once upon"}, {"type": "text", "text": "a time"}]) == reply("Once upon\na time")


def test_an_assistant_turn_that_called_tools_may_have_no_content(server):
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}, {"role": "developer", "content": "ok"}]
    r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_model_without_a_template_that_cannot_spell_the_fallback_is_a_clear_400():
    """A character vocabulary (no Latin letters) cannot write 'user: ...' lines: 400, not a
    prompt full of <unk>."""
    chars = {c: i + 1 for i, c in enumerate("春风送暖入屠苏")}
    tok = types.SimpleNamespace(has_chat_template=False, unk_token_id=0, bos_token_id=None,
                                encode=lambda text, add_special_tokens=True: [chars.get(c, 0) for c in text])
    limits = Limits({"m"}, 64, 16, 8, {"temperature": 1.0}, 1)
    with pytest.raises(APIError) as e:
        render_chat(ChatRequest(messages=[{"role": "user", "content": "春风送暖入屠苏"}]), tok, limits)
    assert e.value.status == 400 and e.value.code == "no_chat_template" and "/v1/completions" in e.value.message
    latin = types.SimpleNamespace(has_chat_template=False, unk_token_id=0, bos_token_id=None,
                                  encode=lambda text, add_special_tokens=True: [ord(c) for c in text])
    ids = render_chat(ChatRequest(messages=[{"role": "user", "content": "Hi"}]), latin, limits)
    assert "".join(map(chr, ids)) == "user: Hi\nassistant:"


@pytest.mark.parametrize("path", ["/healthz", "/ready", "/health"])
def test_probes_answer_head(server, path):
    r = httpx.head(server.url + path)
    assert r.status_code == 200 and r.content == b""
    assert httpx.get(server.url + path).status_code == 200


def test_a_connection_that_never_finishes_its_headers_is_closed(server):
    slow = connect(server)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")           # and never the rest
    assert closed_by_server(slow, within=3.0)
    slow.close()
    trickle = connect(server)                   # a byte at a time does not restart the clock
    start = time.time()
    with pytest.raises(OSError):
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            trickle.sendall(bytes([byte]))
            time.sleep(0.1)
            if closed_by_server(trickle, within=0.01):
                raise ConnectionResetError
    assert time.time() - start < 3.0
    trickle.close()
    # on a kept-alive connection, the clock starts again with the next request's first bytes
    with connect(server) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in s.recv(4096)
        time.sleep(0.8)                         # idle between requests: uvicorn's keep-alive (5 s) governs
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in s.recv(4096)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHo")
        assert closed_by_server(s, within=3.0)
    # a request whose headers came in time may take as long as it needs
    r = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
                                         "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")


def test_a_request_that_would_wait_past_max_queue_wait_s_gets_429_with_that_wait(server):
    """The engine's queue: a request whose place in the queue over the measured drain rate is
    more than max_queue_wait_s gets 429 with that wait as Retry-After; within it, it is queued."""
    from leapfrog.serve.line import DrainRate
    primary = server.state.primary
    engine, saved = primary.engine, (primary.engine.drain, primary.cfg.max_queue_wait_s)
    engine.drain = DrainRate(prior=1.0)          # one request finishes a second while the batch is full
    phantom = engine.places + 2                  # a full batch and two queued
    engine.num_in_flight += phantom
    try:
        primary.cfg.max_queue_wait_s = 2.5       # this one would be third in the queue: 3 s
        r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        err = assert_error(r, 429, "queue_full")
        assert r.headers["Retry-After"] == "3" and "max_queue_wait_s" in err["message"]
        r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2})
        assert r.status_code == 429 and r.headers["Retry-After"] == "4"
        primary.cfg.max_queue_wait_s = 3.0
        assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        engine.num_in_flight -= phantom
        engine.drain, primary.cfg.max_queue_wait_s = saved


def test_one_model_is_retrieved_as_openai_retrieves_it(server):
    listed = httpx.get(server.url + "/v1/models").json()["data"]
    for card in listed:
        r = httpx.get(server.url + f"/v1/models/{card['id']}")
        assert r.status_code == 200 and r.json() == card
    err = assert_error(httpx.get(server.url + "/v1/models/no-such-model"), 404, "model_not_found", "model")
    assert listed[0]["id"] in err["message"]
