"""Defects a user could hit, each with the error it must now give and a check that service goes on:
one request failing the batch, big inputs, values that slipped through, the wrong 429, logprob
tokens that did not join into the text, the schema, shutdown, and unauthenticated surfaces."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from leapfrog.sampling_params import SamplingParams
from test_server_common import ServerThread, assert_error, post, free_port, pace_engine, still_works, wait_ready

POISON = 301        # a token id; a prompt containing it makes the injected fault fire


@pytest.fixture(scope="module")
def server(llama_dir):
    s = ServerThread(llama_dir, max_queue_size=4).start()
    yield s
    s.stop()


def stream_text(server, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


# --- one request must not fail the others -------------------------------------------------------
def test_out_of_range_top_k_fails_only_itself(server, monkeypatch):
    pace_engine(monkeypatch)
    body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    want = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    result = {}
    t = threading.Thread(target=lambda: result.update(r=post(server, "/v1/completions", body)))
    t.start()
    time.sleep(0.05)
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "top_k": 2**70}), 400, "invalid_value", "top_k")
    t.join()
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["text"] == want


def test_a_failing_forward_fails_only_its_request(server, monkeypatch):
    """An injected fault: the model forward raises whenever the poison token is in its batch.
    The engine splits the batch until the poisoned request stands alone; it gets a 500, and the
    requests that shared its steps finish with exactly the tokens they get without it."""
    pace_engine(monkeypatch)
    model = server.state.engine.engine.model
    real = model.forward

    def forward(ids, *args, **kw):
        if bool((ids == POISON).any()):
            raise RuntimeError("injected fault")
        return real(ids, *args, **kw)
    bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
              for p in ("Once upon a time", "The cat", "One day the dog")]
    want = [post(server, "/v1/completions", b).json()["choices"][0]["text"] for b in bodies]
    monkeypatch.setattr(model, "forward", forward)
    results: dict = {}
    threads = [threading.Thread(target=lambda i=i, b=b: results.update({i: post(server, "/v1/completions", b)}))
               for i, b in enumerate(bodies)]
    for th in threads:
        th.start()
    time.sleep(0.03)
    bad = post(server, "/v1/completions", {"prompt": [1, 5, POISON, 7], "max_tokens": 8})
    for th in threads:
        th.join()
    err = assert_error(bad, 500, "internal_error")
    assert "injected fault" in err["message"]
    assert [results[i].json()["choices"][0]["text"] for i in range(3)] == want
    monkeypatch.setattr(model, "forward", real)
    assert server.wait_idle() == 0
    still_works(server.url)


# --- big inputs are refused before they cost anything --------------------------------------------
def test_oversized_body_gets_413(server):
    big = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    r = httpx.post(server.url + "/generate", content=big, headers={"content-type": "application/json"}, timeout=60)
    assert_error(r, 413, "body_too_large")
    ids = json.dumps({"prompt": list(range(1, 100)) * 20000}).encode()   # ~7 MB of token ids
    r = httpx.post(server.url + "/v1/completions", content=ids, headers={"content-type": "application/json"})
    assert_error(r, 413, "body_too_large")
    still_works(server.url)


def test_prompt_too_long_in_characters_is_refused_untokenized(server, monkeypatch):
    limit = server.state.engine.info.max_prompt_chars
    tok = server.state.engine.tokenizer
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **k: (_ for _ in ()).throw(AssertionError("tokenized"))
                        if len(text) > limit else real(text, *a, **k))
    assert_error(post(server, "/generate", {"prompt": "x" * (limit + 1)}), 400, "context_length_exceeded", "prompt")
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (limit + 1)}]})
    assert_error(r, 400, "context_length_exceeded", "messages")
    still_works(server.url)


def test_too_many_stop_strings(server):
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "stop": ["x"] * 100_000}), 400, "invalid_value", "stop")
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "stop": ["x" * 5000]}), 400, "invalid_value", "stop")
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "stop_token_ids": [2**70]}), 400,
                 "invalid_token_id", "stop_token_ids")
    still_works(server.url)


# --- values that slipped through ------------------------------------------------------------------
@pytest.mark.parametrize("raw,param", [
    ('{"prompt": "a\\ud800b"}', "prompt"),
    ('{"prompt": "hi", "temperature": NaN}', "temperature"),
    ('{"prompt": "hi", "temperature": Infinity}', "temperature"),
    ('{"prompt": "hi", "frequency_penalty": NaN}', "frequency_penalty"),
    ('{"prompt": "hi", "repetition_penalty": 1e-300}', "repetition_penalty"),
    ('{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
    ('{"prompt": "hi", "seed": 18446744073709551616, "stream": true}', "seed"),
    ('{"prompt": "hi", "top_k": 100000000000000000000000}', "top_k"),
    ('{"prompt": "hi", "stop": ["\\udfff"]}', "stop.0"),
])
def test_bad_values_get_400_naming_the_field(server, raw, param):
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, None, param)
    still_works(server.url)


def test_surrogate_in_chat_message(server):
    raw = '{"messages": [{"role": "user", "content": "\\ud83d"}]}'
    r = httpx.post(server.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_unicode", "messages.0.content")


def test_tiny_temperature_is_greedy(server):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True}
    greedy = post(server, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]["text"]
    tiny = post(server, "/v1/completions", {**body, "temperature": 1e-300}).json()["choices"][0]["text"]
    assert tiny == greedy
    assert SamplingParams(temperature=1e-300).greedy


def test_largest_seed_with_n_wraps(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "seed": 2**64 - 1, "n": 2, "max_tokens": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_more_generations_than_capacity_is_400_not_429(server):
    capacity = server.state.capacity
    n = server.state.cfg.max_n
    prompts = ["hi"] * (capacity // n + 1)
    r = post(server, "/v1/completions", {"prompt": prompts, "n": n, "max_tokens": 2})
    err = assert_error(r, 400, "too_many_generations", "n")
    assert str(capacity) in err["message"] and "retry-after" not in r.headers
    still_works(server.url)


def test_max_completion_tokens_errors_name_it(server):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for value, code in ((0, "invalid_value"), (10**6, "context_length_exceeded")):
        r = post(server, "/v1/chat/completions", {**chat, "max_completion_tokens": value})
        err = assert_error(r, 400, code, "max_completion_tokens")
        assert err["message"].startswith("max_completion_tokens"), err
    assert_error(post(server, "/v1/chat/completions", {**chat, "max_tokens": 0}), 400, "invalid_value", "max_tokens")


# --- logprob tokens: their text, or their bytes inside a multi-byte character -------------------
def token_bytes(token: str) -> bytes:
    """A legacy logprob token's bytes: "bytes:\\xe6\\x98" (inside a character, OpenAI's form) or its text."""
    if token.startswith("bytes:"):
        return bytes.fromhex(token[len("bytes:"):].replace("\\x", ""))
    return token.encode()


def test_logprob_tokens_give_back_the_text(server):
    """Tokens that are whole characters are the text at their offsets; the random test model also
    writes stray bytes, which show as their bytes. The stream gives the same tokens."""
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    for tok, at in zip(lp["tokens"], lp["text_offset"]):
        assert tok.startswith("bytes:") or text[at:at + len(tok)] == tok, (tok, at, text)
        assert not tok.startswith("bytes:") or at <= len(text)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    streamed = [t for e in stream_text(server, body) for t in (e["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert streamed == lp["tokens"]
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                                 "temperature": 0, "ignore_eos": True, "logprobs": True}).json()
    for c in chat["choices"][0]["logprobs"]["content"]:
        assert bytes(c["bytes"]) == token_bytes(c["token"])


def test_logprob_pieces_keep_sentencepiece_spaces():
    """Decoded alone, a SentencePiece token loses its leading space; after its context it keeps it."""
    from pathlib import Path
    from leapfrog.serve.openai_api import completion_logprobs
    from leapfrog.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(Path(__file__).resolve().parents[2] / "checkpoints" / "stories")
    text = "Once upon a time, there was a little cat named Tom."
    ids = tok.encode(text)           # BOS first
    entries = [{"token_id": t, "logprob": -1.0, "top": [(t, -1.0)]} for t in ids[1:]]
    lp = completion_logprobs(entries, tok, 0, ids[:1])
    assert "".join(lp["tokens"]) == text
    assert [next(iter(d)) for d in lp["top_logprobs"]] == lp["tokens"]
    half = len(entries) // 2             # streamed in two parts: the second knows the first
    first = completion_logprobs(entries[:half], tok, 0, ids[:1])
    second = completion_logprobs(entries[half:], tok, len("".join(first["tokens"])), ids[:1], ids[1:1 + half])
    assert first["tokens"] + second["tokens"] == lp["tokens"]
    assert first["text_offset"] + second["text_offset"] == lp["text_offset"]


@pytest.mark.parametrize("model", ["stories", "smollm2"])
def test_tokens_inside_multibyte_characters_show_their_own_bytes(model):
    """Emoji and CJK characters span several byte tokens (byte fallback in `stories`, byte-level
    BPE in `smollm2`): each such token shows its own bytes, as OpenAI does ("bytes:\\xf0\\x9f";
    chat: `bytes`), whatever token a streamed part starts at, so no two alternatives share a
    key and every chosen token's logprob is under its own key; the bytes join into the text."""
    from leapfrog.config import resolve_model
    from leapfrog.serve.openai_api import chat_logprobs, completion_logprobs
    from leapfrog.tokenizer import IncrementalDetokenizer, Tokenizer
    try:
        tok = Tokenizer.from_folder(resolve_model(model))
    except FileNotFoundError:
        pytest.skip(f"{model} is not installed")
    text = "Emoji party: 🎉🎉🎊🥳 and 春联, 福 too 🧧."
    ids = tok.encode(text)
    bos = ids[:1] if ids[0] == tok.bos_token_id else []
    ids = ids[len(bos):]
    assert len(ids) > len(text.split()) + 10          # characters span several ids
    partial = [i for i in ids if not _whole(tok.token_bytes(i))]
    assert partial
    entries = [{"token_id": t, "logprob": -float(k), "top": [(t, -float(k)), *[(p, -99.0 - j) for j, p in
                enumerate(dict.fromkeys(partial)) if p != t][:4]]} for k, t in enumerate(ids)]
    for cut in range(0, len(entries), 3):
        first = completion_logprobs(entries[:cut], tok, 0, bos)
        sent = len(IncrementalDetokenizer(tok, bos).add(ids[:cut]))      # the text streamed before it
        second = completion_logprobs(entries[cut:], tok, sent, bos, ids[:cut])
        tokens = first["tokens"] + second["tokens"]
        assert b"".join(token_bytes(t) for t in tokens) == text.encode(), (cut, tokens)
        assert all("\ufffd" not in t for t in tokens)
        for t, d, e in zip(tokens, first["top_logprobs"] + second["top_logprobs"], entries):
            assert d[t] == e["logprob"] and len(d) == len(e["top"])       # no two keys the same
        offsets = first["text_offset"] + second["text_offset"]
        for t, at in zip(tokens, offsets):
            assert t.startswith("bytes:") or text[at:at + len(t)] == t
    content = chat_logprobs(entries, tok, bos)["content"]
    assert b"".join(bytes(c["bytes"]) for c in content).decode() == text
    assert [c["token"] for c in content] == completion_logprobs(entries, tok, 0, bos)["tokens"]


def _whole(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


# --- the schema -------------------------------------------------------------------------------------
def test_openapi_has_bodies_errors_and_content_types(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        name = ref.rsplit("/", 1)[1]
        assert "prompt" in doc["components"]["schemas"][name]["properties"] or path.endswith("chat/completions")
        for code in ("400", "413", "415", "429", "500", "503"):
            assert op["responses"][code]["content"]["application/json"]["schema"]["$ref"].endswith("/Error")
        assert "422" not in op["responses"]
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    schemas = doc["components"]["schemas"]
    refs = list(_refs(doc))
    assert refs and all(r.startswith("#/components/schemas/") and r.rsplit("/", 1)[1] in schemas for r in refs)


def _refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


# --- cross-site requests --------------------------------------------------------------------------
@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_non_json_bodies_are_415(server, ctype):
    r = httpx.post(server.url + "/generate", content=b'{"prompt": "hi"}', headers={"content-type": ctype})
    assert_error(r, 415, "unsupported_media_type")
    still_works(server.url)


# --- shutdown ---------------------------------------------------------------------------------------
def test_sigterm_drains_answers_503_and_exits_0(llama_dir):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEAPFROG_")}
    proc = subprocess.Popen([sys.executable, "-m", "leapfrog", "serve", "--model", str(llama_dir), "--port", str(port),
                             "--host", "127.0.0.1", "--warmup-requests", "0", "--log-level", "warning",
                             "--max-batch-size", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        # 16 choices one at a time (batch of 1): seconds of work still in flight at SIGTERM
        body = {"prompt": "Once", "max_tokens": 240, "ignore_eos": True, "stream": True, "n": 16}
        seen = {"ready": None, "new": None, "events": 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)                             # the stream has started
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            seen["ready"] = httpx.get(url + "/ready", timeout=5).status_code
            seen["new"] = httpx.post(url + "/generate", json={"prompt": "hi"}, timeout=5).status_code
            seen["events"] = sum(1 for line in lines if line.startswith("data: "))
        assert seen["ready"] == 503 and seen["new"] == 503
        assert seen["events"] > 1
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "Once"}),
])
def test_response_format_text_and_json_object_are_accepted(server, path, body):
    # clients that send the default explicitly got "unknown field 'response_format'"; json_object
    # constrains the reply (tests/serve/test_structured_outputs.py); json_schema needs its schema
    r = httpx.post(server.url + path, json={**body, "max_tokens": 3, "response_format": {"type": "text"}}, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + path, json={**body, "max_tokens": 3, "response_format": {"type": "json_object"}},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0].get("text", r.json()["choices"][0].get("message", {}).get("content")).startswith("{")
    r = httpx.post(server.url + path, json={**body, "max_tokens": 3, "response_format": {"type": "json_schema"}},
                   timeout=30)
    assert "json_schema.schema" in assert_error(r, 400, param="response_format.json_schema")["message"]


def test_every_operation_has_its_own_id(server):
    """OpenAPI requires unique operationIds (clients generated from the document name methods by
    them): the probes' GET and HEAD are two operations."""
    doc = httpx.get(server.url + "/openapi.json").json()
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert {"get", "head"} <= set(doc["paths"]["/healthz"])


def test_a_request_larger_than_the_kv_cache_is_a_400(llama_dir):
    """The cache holds 64 tokens: a request that needs more can never run. Its own fault, so a
    400 that says what to change, not a 500; the server goes on serving what fits."""
    s = ServerThread(llama_dir, kv_cache_tokens=64, block_size=16, max_batch_size=2).start()
    try:
        r = post(s, "/v1/completions", {"prompt": "word " * 20, "max_tokens": 60, "ignore_eos": True})
        assert r.status_code == 400 and "KV cache" in r.json()["error"]["message"], r.text
        still_works(s.url)
    finally:
        s.stop()
