"""The OpenAPI document: FastAPI's, plus what it cannot see because the handlers read raw bodies
(request schemas from the pydantic models the server validates with, with the ranges
SamplingParams and the server check), the response bodies, every error response in the OpenAI
error shape, and the right content types (/metrics is Prometheus text, streams are server-sent
events, an HTML page is HTML). Guests of the server add their routes' entries (Extension).

The request schemas over-approximate what is accepted: every body the schema rejects, the server
rejects; a body the schema allows may still get a 400 for what only its content shows (a prompt
longer than the context)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from leapfrog.sampling_params import BOUNDS as SAMPLING_BOUNDS
from leapfrog.sampling_params import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS
from leapfrog.serve.protocol import (ChatRequest, CompletionRequest, DetokenizeRequest, FaultRequest,
                                    GenerateRequest, TokenizeRequest)

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/generate": GenerateRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
    "/admin/fault": FaultRequest,           # only with --fault-injection
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
# status -> when it is answered
GENERATION_ERRORS = {
    "400": "invalid request: the error names the field",
    "401": "authentication required or invalid",
    "404": "unknown model",
    "413": "request body larger than max_body_bytes",
    "415": "body is not JSON",
    "429": "rate limited or queue full; see Retry-After",
    "499": "client closed the connection",
    "500": "this request failed inside the engine",
    "503": "model loading or server draining; see Retry-After",
    "504": "request ran past request_timeout",
}
REF_TEMPLATE = "#/components/schemas/{model}"
# Numeric ranges of request fields, by field name: SamplingParams' own table (BOUNDS there), plus
# the HTTP names of its fields (tests/serve/test_server_fuzz.py checks each boundary against the
# server).
_SAMPLING = {name: bound.json_schema() for name, bound in SAMPLING_BOUNDS.items()}
BOUNDS: dict[str, dict] = {
    **_SAMPLING,
    "max_length": _SAMPLING["max_tokens"], "max_completion_tokens": _SAMPLING["max_tokens"],
    "top_logprobs": _SAMPLING["logprobs"],
}
_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}


def error_schema() -> dict:
    detail = {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}
    return {"type": "object", "required": ["error"], "properties": {"error": detail}}


def obj(required: dict, optional: dict | None = None) -> dict:
    return {"type": "object", "required": list(required), "properties": {**required, **(optional or {})}}


STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
_NULLABLE_STR = {"type": ["string", "null"]}
_USAGE = obj({"prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT})


def response_schemas() -> dict[str, dict]:
    """The JSON bodies of the 200 answers, by component name."""
    ref = REF_TEMPLATE.format
    completion_logprobs = {"type": ["object", "null"], "required": ["tokens", "token_logprobs", "text_offset"]}
    prompt_logprobs = {"type": ["array", "null"], "items": {"type": ["object", "null"]}}
    ids = {"type": "array", "items": INT}       # return_token_ids (vLLM's)
    choice = obj({"index": INT, "text": STR, "logprobs": completion_logprobs, "finish_reason": _NULLABLE_STR},
                  {"prompt_logprobs": prompt_logprobs, "prompt_token_ids": ids, "token_ids": ids})
    message = obj({"role": {"const": "assistant"}, "content": STR})
    chat_choice = obj({"index": INT, "message": message, "logprobs": {"type": ["object", "null"]},
                        "finish_reason": _NULLABLE_STR}, {"token_ids": ids})
    head = {"id": STR, "created": INT, "model": STR, "usage": {"$ref": ref(model="Usage")}}
    return {
        "Usage": _USAGE,
        "GenerateResponse": obj({"text": STR, "model": STR, "num_tokens": INT, "prompt_tokens": INT,
                                  "finish_reason": _NULLABLE_STR, "tokens_per_forward": NUM,
                                  "timing": obj({"total_s": NUM, "time_to_first_token_s": {"type": ["number", "null"]},
                                                  "tokens_per_s": NUM})}),
        "CompletionResponse": obj({**head, "object": {"const": "text_completion"},
                                    "choices": {"type": "array", "items": choice}}),
        "ChatCompletionResponse": obj({**head, "object": {"const": "chat.completion"},
                                        "choices": {"type": "array", "items": chat_choice}},
                                       {"prompt_token_ids": ids}),
        "ModelCard": obj({"id": STR, "object": {"const": "model"}, "created": INT, "owned_by": STR},
                         {"max_model_len": INT, "method": STR}),
        "ModelList": obj({"object": {"const": "list"}, "data": {"type": "array", "items": {
            "$ref": REF_TEMPLATE.format(model="ModelCard")}}}),
        "Status": obj({"status": STR}),
        "TokenizeResponse": obj({"count": INT, "max_model_len": INT,
                                  "tokens": {"type": "array", "items": INT}}),
        "DetokenizeResponse": obj({"prompt": STR}),
    }


# One server-sent event (OpenAPI 3.1: the event-stream schema describes each event): `data` is a
# JSON chunk of the response's streaming shape, an error object, or the final [DONE].
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}, "event": STR, "id": STR, "retry": INT}}

RESPONSE_BODIES = {     # path -> the 200 answer's JSON schema(s) (the stream's is text/event-stream)
    "/generate": ["GenerateResponse"],
    "/v1/completions": ["CompletionResponse"],
    "/v1/chat/completions": ["ChatCompletionResponse"],
    "/v1/models": ["ModelList"], "/v1/models/{model}": ["ModelCard"],
    "/tokenize": ["TokenizeResponse"], "/detokenize": ["DetokenizeResponse"],
    "/health": ["Status"], "/healthz": ["Status"], "/ready": ["Status"],
}


def _bound(prop: dict, bound: dict) -> None:
    """Put a numeric range on a property, or on the numeric branches of its anyOf."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") in ("integer", "number"):
            branch.update(bound)


def refine_request(name: str, schema: dict, max_n: int) -> None:
    """The ranges and lengths the server checks, added to a pydantic model's JSON schema."""
    props = schema.get("properties", {})
    for field, prop in props.items():
        bound = BOUNDS.get(field)
        if field == "n":
            bound = {"minimum": 1, "maximum": max_n}
        elif field == "max_tokens" and name == "CompletionRequest":   # 0: with echo, score the prompt only
            bound = {**BOUNDS["max_tokens"], "minimum": 0}
        if bound:
            _bound(prop, bound)
    if "stop" in props:
        props["stop"]["anyOf"] = [_STOP_STRING, {"type": "array", "items": _STOP_STRING, "maxItems": MAX_STOP_STRINGS},
                                  {"type": "null"}]
    for branch in props.get("prompt", {}).get("anyOf", []):
        if branch.get("type") == "string":
            if name != "TokenizeRequest":       # "" tokenizes (to no tokens); generation needs a prompt
                branch["minLength"] = 1
        elif branch.get("type") == "array":
            branch["minItems"] = 1
            items = branch["items"]
            if items.get("type") == "integer":
                items["minimum"] = 0
            elif items.get("type") == "string":
                items["minLength"] = 1
            elif items.get("type") == "array":
                items.update({"minItems": 1, "items": {"type": "integer", "minimum": 0}})
    for branch in props.get("logit_bias", {}).get("anyOf", []):
        if branch.get("type") == "object":       # token id (decimal string) -> bias
            branch.update({"propertyNames": {"pattern": "^[0-9]+$"}, "maxProperties": MAX_LOGIT_BIAS})
            branch["additionalProperties"] = {"type": "number", "minimum": -LOGIT_BIAS_RANGE,
                                              "maximum": LOGIT_BIAS_RANGE}
    if "messages" in props:
        props["messages"]["minItems"] = 1
    if name == "GenerateRequest":       # a prompt (a guest may add other forms: Extension.refine)
        schema["anyOf"] = [{"required": ["prompt"], "properties": {"prompt": {"not": {"type": "null"}}}}]


@dataclass
class Extension:
    """What a guest of the server (an app installed on it, such as serve/couplet.py) adds to the
    document: request bodies and 200 answers of its routes (by path; a path the core has gets
    its answers added), response schemas by name, HTML pages (GET path -> description), optional
    fields of /v1/models' cards, and a refinement of request schemas (name, schema) run after
    the core's."""
    request_bodies: dict[str, type[BaseModel]] = field(default_factory=dict)
    response_schemas: dict[str, dict] = field(default_factory=dict)
    response_bodies: dict[str, list[str]] = field(default_factory=dict)
    html_pages: dict[str, str] = field(default_factory=dict)
    model_card: dict[str, dict] = field(default_factory=dict)
    refine: Callable[[str, dict], None] | None = None


@dataclass
class _Document:
    """The core's tables with the extensions' entries merged in."""
    request_bodies: dict[str, type[BaseModel]]
    response_bodies: dict[str, list[str]]
    html_pages: dict[str, str]
    refines: list[Callable[[str, dict], None]]

    @classmethod
    def merge(cls, extensions: list[Extension]) -> "_Document":
        doc = cls(dict(REQUEST_BODIES), {k: list(v) for k, v in RESPONSE_BODIES.items()}, {}, [])
        for ext in extensions:
            doc.request_bodies.update(ext.request_bodies)
            for path, names in ext.response_bodies.items():
                doc.response_bodies.setdefault(path, []).extend(names)
            doc.html_pages.update(ext.html_pages)
            if ext.refine is not None:
                doc.refines.append(ext.refine)
        return doc


def _error_responses(codes: dict[str, str]) -> dict:
    ref = {"$ref": "#/components/schemas/Error"}
    return {code: {"description": why, "content": {"application/json": {"schema": ref}}}
            for code, why in codes.items()}


def _json_200(names: list[str]) -> dict:
    refs = [{"$ref": REF_TEMPLATE.format(model=n)} for n in names]
    return {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}


def build_openapi(app: FastAPI, auth_enabled: bool, max_n: int = 16, extensions: list[Extension] | None = None) -> dict:
    extensions = extensions or []
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = error_schema()
    schemas.update(response_schemas())
    for ext in extensions:
        schemas.update(ext.response_schemas)
        schemas["ModelCard"]["properties"].update(ext.model_card)
    tables = _Document.merge(extensions)
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            _complete(path, method, op, schemas, auth_enabled, max_n, tables)
    return doc


def _complete(path: str, method: str, op: dict, schemas: dict, auth_enabled: bool, max_n: int,
              tables: _Document) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)            # FastAPI's validation shape is never used here
    if method == "post" and path in tables.request_bodies:
        model = tables.request_bodies[path]
        schema = model.model_json_schema(ref_template=REF_TEMPLATE)
        schemas.update(schema.pop("$defs", {}))
        refine_request(model.__name__, schema, max_n)
        for refine in tables.refines:
            refine(model.__name__, schema)
        schemas[model.__name__] = schema
        op["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": REF_TEMPLATE.format(model=model.__name__)}}}}
        if path == "/admin/fault":
            schema["properties"]["fault"]["enum"] = ["engine_crash"]
            responses.pop("200", None)
            responses["202"] = {"description": "the engine will die at its next turn and be rebuilt", "content": {
                "application/json": {"schema": obj({"fault": STR, "model": STR})}}}
            responses.update(_error_responses({c: GENERATION_ERRORS[c] for c in ("400", "401", "404", "413",
                                                                                    "415", "503")}))
            return
        content = {"application/json": _json_200(tables.response_bodies[path])}
        if "stream" in schema.get("properties", {}):
            content["text/event-stream"] = {"schema": SSE_EVENT}
        responses["200"] = {"description": "OK", "content": content}
        if path in ("/tokenize", "/detokenize"):      # no engine work: no queue, no timeout
            responses.update(_error_responses({c: GENERATION_ERRORS[c] for c in ("400", "401", "404", "413",
                                                                                "415", "503")}))
        else:
            responses.update(_error_responses(GENERATION_ERRORS))
    elif path == "/metrics":
        responses["200"] = {"description": "Prometheus text exposition format",
                            "content": {"text/plain": {"schema": {"type": "string"}}}}
    elif method == "get" and path in tables.html_pages:
        responses["200"] = {"description": tables.html_pages[path], "content": {"text/html": {"schema": STR}}}
    elif path in tables.response_bodies:
        responses["200"] = {"description": "OK", "content": {"application/json": _json_200(tables.response_bodies[path])}}
        if path in ("/health", "/healthz", "/ready"):
            responses["503"] = {"description": "not healthy / not ready",
                                "content": {"application/json": _json_200(["Status"])}}
    if auth_enabled and path not in ("/healthz", "/ready"):
        responses.update(_error_responses({"401": GENERATION_ERRORS["401"]}))
    if path == "/v1/models":
        responses.update(_error_responses({"401": GENERATION_ERRORS["401"]}))
    if path == "/v1/models/{model}":
        responses.update(_error_responses({c: GENERATION_ERRORS[c] for c in ("401", "404")}))


def install(app: FastAPI, auth_enabled: bool, max_n: int = 16, extensions: list[Extension] | None = None) -> None:
    """Replace app.openapi with the completed document (built once, on first request, with the
    extensions in the list by then: guests installed after this call are included)."""
    cache: dict[str, Any] = {}
    extensions = extensions if extensions is not None else []

    def openapi() -> dict:
        if "doc" not in cache:
            cache["doc"] = build_openapi(app, auth_enabled, max_n, extensions)
        return cache["doc"]
    app.openapi = openapi
