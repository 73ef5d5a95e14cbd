"""Structured outputs over HTTP: OpenAI's response_format and vLLM's structured_outputs /
guided_* fields constrain the reply; a bad constraint is a 400 naming its field, and the
requests in flight go on token for token as without it."""
from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import pytest
import regex

from test_server_common import ServerThread, post

# compiles, then goes past llguidance's limits (a parser row of 2,000 items) at its first tokens
WIDE = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}
SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["mood", "count"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = ServerThread(llama_dir).start()
    yield srv
    srv.stop()


def chat(server, **fields) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me how you feel."}],
            "max_tokens": 40, "temperature": 0, **fields}
    return post(server, "/v1/chat/completions", body)


def test_response_format_json_schema_and_json_object(server):
    r = chat(server, response_format={"type": "json_schema", "json_schema": {"name": "feeling", "schema": SCHEMA,
                                                                               "strict": True}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)
    r = chat(server, response_format={"type": "json_object"}, max_tokens=60)
    text = r.json()["choices"][0]["message"]["content"]
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:                          # cut by max_tokens: still a JSON object's beginning
        assert text.startswith("{")
    assert chat(server, response_format={"type": "text"}).status_code == 200


@pytest.mark.parametrize("fields,check", [
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"guided_regex": r"\d{3}-[a-z]{2}"}, lambda t: regex.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_grammar": 'root ::= "up" | "down"'}, lambda t: t in ("up", "down")),
    ({"structured_outputs": {"choice": ["x", "y"]}}, lambda t: t in ("x", "y")),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
])
def test_vllm_fields_constrain_chat_completions_and_generate(server, fields, check):
    r = chat(server, **fields)
    assert r.status_code == 200, r.text
    assert check(r.json()["choices"][0]["message"]["content"])
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 40,
                                         "temperature": 0.8, "seed": 3, **fields})
    assert check(r.json()["choices"][0]["text"])
    r = post(server, "/generate", {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, **fields})
    assert check(r.json()["text"])


def test_a_stream_under_a_constraint_joins_to_a_conforming_reply(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0,
            "stream": True, "guided_json": SCHEMA}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), SCHEMA)


def test_a_constraint_that_fails_while_streaming_ends_in_an_error_naming_its_field(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0,
            "stream": True, "guided_json": WIDE}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    errors = [json.loads(f)["error"] for f in frames if f.startswith("{") and "error" in json.loads(f)]
    assert errors and errors[0]["param"] == "guided_json" and "limits" in errors[0]["message"], frames
    assert frames[-1] == "[DONE]"


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(30000))}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": '{"type": '}, "guided_json"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"nosuch": 1}}, "structured_outputs.nosuch"),
    ({"guided_json": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}, "guided_json"),  # no first mask
    ({"guided_json": WIDE}, "guided_json"),            # past the grammar engine's limits once decoding
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": WIDE}}}, "response_format"),
])
def test_bad_constraints_are_400s_naming_the_field(server, fields, param):
    r = chat(server, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_bad_constraints_leave_requests_in_flight_unharmed(server):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    want = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    got: list[str] = []

    def run() -> None:
        got.append(post(server, "/v1/completions", body).json()["choices"][0]["text"])
    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in range(6):
        assert chat(server, guided_regex="([a-z]").status_code == 400
        assert chat(server, guided_json={"type": "object", "properties": {"a": {"type": 5}}}).status_code == 400
    assert chat(server, guided_json=WIDE).status_code == 400
    for t in threads:
        t.join()
    assert got == [want] * 3
    assert httpx.get(server.url + "/health").status_code == 200
