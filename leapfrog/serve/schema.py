"""The OpenAPI document: FastAPI's, plus what it cannot see because the handlers read raw bodies
(request schemas from the pydantic models the server validates with), every error response in
the OpenAI error shape, and the right content types (/metrics is Prometheus text, streams are
server-sent events)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from leapfrog.serve.protocol import ChatRequest, CompletionRequest, CoupletRequest, GenerateRequest

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/generate": GenerateRequest,
    "/couplet": CoupletRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
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


def error_schema() -> dict:
    detail = {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}
    return {"type": "object", "required": ["error"], "properties": {"error": detail}}


def _error_responses(codes: dict[str, str]) -> dict:
    ref = {"$ref": "#/components/schemas/Error"}
    return {code: {"description": why, "content": {"application/json": {"schema": ref}}}
            for code, why in codes.items()}


def build_openapi(app: FastAPI, auth_enabled: bool) -> dict:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = error_schema()
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            _complete(path, method, op, schemas, auth_enabled)
    return doc


def _complete(path: str, method: str, op: dict, schemas: dict, auth_enabled: bool) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)            # FastAPI's validation shape is never used here
    if method == "post" and path in REQUEST_BODIES:
        model = REQUEST_BODIES[path]
        schema = model.model_json_schema(ref_template=REF_TEMPLATE)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        op["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": REF_TEMPLATE.format(model=model.__name__)}}}}
        ok = responses.setdefault("200", {"description": "OK"})
        ok["content"] = {"application/json": {"schema": {"type": "object"}},
                         "text/event-stream": {"schema": {"type": "string"}}}
        responses.update(_error_responses(GENERATION_ERRORS))
    elif path == "/metrics":
        responses["200"] = {"description": "Prometheus text exposition format",
                            "content": {"text/plain": {"schema": {"type": "string"}}}}
    elif path in ("/health", "/healthz", "/ready"):
        responses["503"] = {"description": "not healthy / not ready",
                            "content": {"application/json": {"schema": {"type": "object"}}}}
    if auth_enabled and path not in ("/health", "/healthz", "/ready"):
        responses.update(_error_responses({"401": GENERATION_ERRORS["401"]}))
    if path == "/v1/models":
        responses.update(_error_responses({"401": GENERATION_ERRORS["401"]}))


def install(app: FastAPI, auth_enabled: bool) -> None:
    """Replace app.openapi with the completed document (built once, on first request)."""
    cache: dict[str, Any] = {}

    def openapi() -> dict:
        if "doc" not in cache:
            cache["doc"] = build_openapi(app, auth_enabled)
        return cache["doc"]
    app.openapi = openapi
