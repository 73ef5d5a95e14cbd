"""Tool calling in OpenAI's format: `tools`, `tool_choice`, `parallel_tool_calls`.

Tools reach the model through its chat template, or else through Hermes's format (vLLM's hermes
parser). `required` and a named function are enforced by constrained decoding, so even a small
model returns well-formed calls; `auto` parses calls out of free text. (docs/decisions.md,
"Structured outputs, tools and the chat page")"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from leapfrog.sampling_params import StructuredOutputs
from leapfrog.serve.protocol import bad_request
from leapfrog.tokenizer import TOOL_CALL_CLOSE as CLOSE, TOOL_CALL_OPEN as OPEN, tool_messages

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
ANY_OBJECT = {"type": "object"}
# Calls in one `required` reply: twice the tools offered, at most this. Unbounded, a small model
# greedily repeats its first call until max_tokens cuts the JSON short.
MAX_PARALLEL_CALLS = 8


@dataclass
class ToolPlan:
    """What a chat request's tools ask: mode none / auto / required / named."""
    mode: str = "none"
    tools: list[dict] = field(default_factory=list)      # OpenAI tool objects, as sent
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.mode != "none"

    def constraint(self) -> StructuredOutputs | None:
        """The decoding constraint of `required` and named choices (None: free text)."""
        if self.mode == "named":
            return StructuredOutputs(json=parameters(self.function(self.named)), field="tool_choice")
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "parameters": parameters(t["function"])},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        item = calls[0] if len(calls) == 1 else {"anyOf": calls}
        array = {"type": "array", "items": item, "minItems": 1,
                 "maxItems": min(MAX_PARALLEL_CALLS, 2 * len(self.tools)) if self.parallel else 1}
        return StructuredOutputs(json=array, field="tools")

    def function(self, name: str | None) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def parameters(function: dict) -> dict:
    return function.get("parameters") or ANY_OBJECT


def plan_tools(req: Any) -> ToolPlan:
    """Check `tools`, `tool_choice` and `parallel_tool_calls`; a 400 names the field."""
    tools = req.tools or []
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f"{where}: a tool is {{\"type\": \"function\", \"function\": {{...}}}}", where,
                              "invalid_value")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise bad_request(f"{where}.function.name: {name!r} is not a function name (1-64 of a-z, A-Z, 0-9, "
                              "_ . -)", f"{where}.function.name", "invalid_value")
        if name in names:
            raise bad_request(f"{where}.function.name: {name!r} is named twice", f"{where}.function.name",
                              "invalid_value")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters: must be a JSON Schema object",
                              f"{where}.function.parameters", "invalid_value")
        extra = set(fn) - {"name", "description", "parameters", "strict"}
        if extra:
            raise bad_request(f"{where}.function: unknown field {sorted(extra)[0]!r}", f"{where}.function",
                              "unknown_field")
    choice = req.tool_choice
    plan = ToolPlan(tools=list(tools), parallel=req.parallel_tool_calls is not False)   # null: the default
    if choice is None:
        plan.mode = "auto" if tools else "none"
    elif isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice: {choice!r} is not none, auto, required or a function",
                              "tool_choice", "invalid_value")
        plan.mode = choice
    else:
        fn = choice.get("function") if isinstance(choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request('tool_choice: a named choice is {"type": "function", "function": {"name": ...}}',
                              "tool_choice", "invalid_value")
        if name not in names:
            raise bad_request(f"tool_choice: no tool named {name!r} in tools", "tool_choice", "unknown_tool")
        plan.mode, plan.named = "named", name
    if plan.mode in ("required", "named") and not tools:
        raise bad_request(f"tool_choice: {plan.mode} needs tools", "tool_choice", "invalid_value")
    return plan


def check_tool_schemas(plan: ToolPlan, compile_schema: Any) -> None:
    """Compile every tool's parameters schema (cached), so a malformed one is a 400 naming it
    even when this reply would not have used it."""
    for i, tool in enumerate(plan.tools):
        where = f"tools.{i}.function.parameters"
        compile_schema(StructuredOutputs(json=parameters(tool["function"]), field=where))


# --- the prompt -------------------------------------------------------------------------------
def render_messages(messages: list[dict], plan: ToolPlan, template_reads_tools: bool) -> tuple[list[dict], dict]:
    """(messages, template keyword arguments) of a conversation with the plan's tools
    (tokenizer.tool_messages)."""
    return tool_messages(messages, plan.tools or None, template_reads_tools)


def check_history(messages: list[Any]) -> None:
    """tool_calls on assistant turns and tool_call_id on tool turns, in OpenAI's shapes."""
    for i, m in enumerate(messages):
        calls = getattr(m, "tool_calls", None)
        if calls is not None:
            if m.role != "assistant" or not isinstance(calls, list):
                raise bad_request(f"messages.{i}.tool_calls: only an assistant message has tool_calls (a list)",
                                  f"messages.{i}.tool_calls", "invalid_value")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request(f"messages.{i}.tool_calls.{j}: a call is {{\"id\", \"type\": \"function\", "
                                      "\"function\": {\"name\", \"arguments\"}}", f"messages.{i}.tool_calls.{j}",
                                      "invalid_value")


# --- the reply --------------------------------------------------------------------------------
def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: str, arguments: Any) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def parse_reply(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished reply."""
    if not plan.active:
        return text, []
    if plan.mode == "named":
        return None, [make_call(plan.named, text)]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:          # cut short by max_tokens: no call can be read
            return text, []
        return None, [make_call(c["name"], c.get("parameters", {})) for c in items if isinstance(c, dict)]
    return parse_auto(text, {t["function"]["name"] for t in plan.tools}, plan.parallel)


def parse_auto(text: str, names: set[str], parallel: bool = True) -> tuple[str | None, list[dict]]:
    """(content, calls) of an `auto` reply (split_auto), the content stripped."""
    pieces, calls = split_auto(text, names, parallel)
    if not calls:
        return text, []
    content = "".join(pieces).strip()
    return content or None, calls


def split_auto(text: str, names: set[str], parallel: bool = True) -> tuple[list[str], list[dict]]:
    """(the text outside the calls, as written; the calls) of an `auto` reply: Hermes
    <tool_call> blocks, or a reply that is one {"name", "arguments"} object. Calls of unknown
    functions or with unreadable JSON stay text; with parallel_tool_calls false only the first
    call is returned (vLLM's rule), and the text of later calls is dropped with them."""
    calls, kept, pos = [], [], 0
    for m in re.finditer(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", text, re.S):
        call = _read_call(m.group(1), names)
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    if not calls:
        call = _read_call(text.strip(), names)
        return ([], [call]) if call is not None else ([text], [])
    kept.append(text[pos:])
    return kept, calls if parallel else calls[:1]


def _read_call(body: str, names: set[str]) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return make_call(obj["name"], args) if isinstance(args, (dict, str)) else None


class ToolStream:
    """A streamed reply's tool calls as OpenAI's `tool_calls` deltas. A named function streams
    its arguments as they come; `required` and `auto` hold the text back from the first sign of
    a call and send the calls, whole, when the reply ends (auto's other text streams as
    content)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0                 # characters of text already sent as content
        self.named_started = False
        self.named_id = call_id()

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict], bool]:
        """(content delta, tool-call deltas, whether the reply ended in calls)."""
        self.text += delta
        plan = self.plan
        if not plan.active:
            return delta, [], False
        if plan.mode == "named":
            out = []          # one entry per index a chunk, as OpenAI sends: the first carries the header
            if not self.named_started:
                self.named_started = True
                out.append({"index": 0, "id": self.named_id, "type": "function",
                            "function": {"name": plan.named, "arguments": delta}})
            elif delta:
                out.append({"index": 0, "function": {"arguments": delta}})
            return "", out, finished
        if not finished:
            if plan.mode == "required":
                return "", [], False
            safe = self._safe_end()
            piece, self.sent = self.text[self.sent:safe], max(self.sent, safe)
            return piece, [], False
        if plan.mode == "auto":
            pieces, calls = split_auto(self.text, {t["function"]["name"] for t in plan.tools}, plan.parallel)
            raw = "".join(pieces)          # starts with what was sent: no call begins before it
            rest = raw[self.sent:].rstrip()
            if not self.text[:self.sent].strip():
                rest = rest.lstrip()
        else:
            rest, calls = "", parse_reply(self.text, plan)[1]
        if not calls:
            piece, self.sent = self.text[self.sent:], len(self.text)
            return piece, [], False
        deltas = [{"index": k, **c} for k, c in enumerate(calls)]
        return rest, deltas, True

    def _safe_end(self) -> int:
        """Text up to here can be sent: no <tool_call> starts in it, nor could one start at its end."""
        at = self.text.find(OPEN, self.sent)
        if at >= 0:
            return at
        for k in range(min(len(OPEN) - 1, len(self.text)), 0, -1):
            if OPEN.startswith(self.text[-k:]):
                return len(self.text) - k
        if self.sent == 0 and self.text.lstrip().startswith("{"):   # maybe a bare call object
            return 0
        return len(self.text)
