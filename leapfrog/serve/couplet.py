"""The couplet terminal, a guest of the HTTP server: `GET /couplet` (the page), `POST /couplet`
and the couplet guide's form of `POST /generate` (`{"keywords": ...}`). `install` adds them to an
app built by `app.create_app`; the HTTP core, its schema and the engine know nothing of couplets.

Each served model that can write couplets (one token per Chinese character) gets a desk: its
couplet writer and a waiting line of its own (`max_couplets_in_flight` written at once, the others
waiting while their expected wait fits `max_couplet_wait_s`)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse
from starlette.background import BackgroundTask

from leapfrog.couplet import rules
from leapfrog.couplet.writer import CoupletWriter, couplets_per_second
from leapfrog.sampling_params import SEED_RANGE
from leapfrog.serve.app import (SSE_HEADERS, ClientWatch, ModelServer, ServerState, as_api_error, read_body,
                                run_to_end, sse_event)
from leapfrog.serve.engine_thread import EngineError, RequestTimeout
from leapfrog.serve.line import LineFull, WaitingLine, retry_after_s
from leapfrog.serve.openai_api import Prepared
from leapfrog.serve.protocol import APIError, GenerateRequest, StrictModel, bad_request, parse_body
from leapfrog.serve.schema import BOOL, INT, NUM, STR, Extension, obj

log = logging.getLogger(__name__)

COUPLET_METHODS = ("constrained", "free")
MAX_CANDIDATES = 16
COUPLET_PAGE = Path(__file__).parent / "static" / "couplet.html"
COUPLET_UPDATE_S = 1.0      # how often a streamed couplet's place in line is refreshed
GENERATE_FIELDS = frozenset({"keywords", "seed", "model"})   # what /generate's couplet form takes


class CoupletRequest(StrictModel):
    """POST /couplet: a couplet (上联, 下联, 横批) for a few keywords."""
    keywords: str
    seed: int | None = None                # the same keywords and seed write the same couplet
    method: str = "constrained"            # "constrained" (rules enforced, candidates reranked) or "free"
    num_candidates: int | None = None      # constrained only: candidates written and reranked (None: 8,
                                           # fewer while the engine is busy)
    model: str | None = None               # default: the first served model that writes couplets
    stream: bool = False                   # server-sent events: place in line, then the couplet


class Desk:
    """One served model's couplet writer (made on first use) and waiting line."""

    def __init__(self, server: ModelServer) -> None:
        self.server = server
        self._writer: Any = None
        self.line = WaitingLine(server.cfg.max_couplets_in_flight, server.cfg.max_couplet_wait_s)

    def writer(self) -> CoupletWriter | None:
        """The couplet writer over this model's tokenizer, or None when the model cannot write
        couplets (its vocabulary is not one token per Chinese character)."""
        if self._writer is None:
            try:
                self._writer = CoupletWriter(self.server.engine.tokenizer)
            except ValueError:
                self._writer = False
        return self._writer or None

    def candidates(self) -> int:
        """Candidates per couplet when the request names none: the running batch shared among
        the couplets being written (8 each for up to 8 couplets at the default 64, then 4, then
        2), so that the candidates in flight fit one batch and none waits in the queue: a couplet
        stays on time under load, a little less polished."""
        return self.candidates_at(self.line.in_use)

    def candidates_at(self, num_couplets: int) -> int:
        share = self.server.engine.places // max(1, num_couplets)
        wanted = 8 if share >= 8 else 4 if share >= 4 else 2
        return max(1, min(wanted, self.server.capacity))      # never more than the server holds at once

    def prepare(self) -> None:
        """Before /ready (in the engine thread, after its warm-up): build the couplet writer,
        load the tone dictionary, and write a full house of couplets at once, which times the
        rate the couplet line starts from (until couplets served under load measure it)."""
        if self.server.cfg.warmup_requests and self.writer() is not None:
            rules.tones("春回大地")
            line = self.line
            line.drain.prior = couplets_per_second(self.server.engine.engine, self.writer(), line.places,
                                                   self.candidates_at(line.places))
            log.info("%s: %.1f couplets a second with all %d couplet places taken (warm-up)",
                     self.server.model_id, line.drain.prior, line.places)


def desk(server: ModelServer) -> Desk:
    return server.guests["couplet"]


def couplet_server(state: ServerState, name: str | None) -> ModelServer:
    """The server that writes couplets: the one named, else the first that can."""
    if name is not None:
        server = state.route(name)
        if desk(server).writer() is None:
            raise bad_request(f"the model {name!r} cannot write couplets (it needs one token per Chinese "
                              "character, as the built-in `couplets` model has)", "model", "not_a_couplet_model")
        return server
    for server in state.servers:
        if server.engine.ready.is_set() and desk(server).writer() is not None:
            return server
    if not all(m.engine.ready.is_set() for m in state.servers):
        raise APIError(503, "the models are still loading", "server_error", None, "not_ready", {"Retry-After": "5"})
    raise APIError(404, "no served model writes couplets: serve the built-in `couplets` model "
                   "(leapfrog serve --model stories --model couplets)", "invalid_request_error", "model",
                   "model_not_found")


def install(app: FastAPI, state: ServerState) -> None:
    """Adds the couplet terminal to `app`: a desk per served model, the routes, the couplet form
    of /generate, the `couplets` flag of /v1/models' cards and the OpenAPI entries."""
    for server in state.servers:
        d = Desk(server)
        server.guests["couplet"] = d
        server.warmup_hooks.append(d.prepare)
    state.model_card_fields.append(
        lambda m: {"couplets": m.engine.ready.is_set() and desk(m).writer() is not None})
    state.generate_variants["keywords"] = _generate_couplet
    state.schema_extensions.append(SCHEMA)

    @app.get("/couplet", response_class=HTMLResponse)
    async def couplet_page() -> HTMLResponse:
        """The couplet terminal (春联生成终端): a palace gate that opens on a fresh couplet."""
        return HTMLResponse(COUPLET_PAGE.read_text(encoding="utf-8"),
                            headers={"Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline'; "
                                     "script-src 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'",
                                     "X-Content-Type-Options": "nosniff"})

    @app.post("/couplet")
    async def couplet(request: Request) -> Any:
        """Keywords in; 上联, 下联 and 横批 out, with the rules that held and the time taken.
        With `stream: true`, server-sent events: `queued` (place in line, expected wait) while
        waiting, `writing`, then `couplet` (the same body) or `error`."""
        arrival = time.perf_counter()
        state.admit(request)
        raw = await read_body(request, state.cfg.max_body_bytes)
        req = parse_body(raw, CoupletRequest)
        server, keywords, ticket = _enter_line(state, req)
        if req.stream:
            # the background task releases the ticket even if streaming never started
            return StreamingResponse(_events(server, ticket, req, keywords, arrival),
                                     media_type="text/event-stream", headers=SSE_HEADERS,
                                     background=BackgroundTask(desk(server).line.release, ticket))
        return await _write(server, request, ticket, req, keywords, arrival)


async def _generate_couplet(state: ServerState, request: Request, body: dict, arrival: float) -> dict:
    """POST /generate with keywords instead of a prompt (the couplet guide's contract): the
    couplet as its three lines of text, plus POST /couplet's fields. Only keywords, seed and
    model apply; any other field set to something but its default is a 400."""
    keywords = body["keywords"]
    if not isinstance(keywords, str):
        raise bad_request("keywords: must be a string", "keywords")
    req = parse_body(json.dumps({k: v for k, v in body.items() if k != "keywords"}).encode(), GenerateRequest)
    if req.prompt is not None:
        raise bad_request("give either prompt or keywords, not both", "keywords")
    unused = [f for f in sorted(req.model_fields_set - GENERATE_FIELDS)
              if getattr(req, f) != GenerateRequest.model_fields[f].default]
    if unused:      # silently ignoring e.g. a temperature would mislead
        raise bad_request(f"{unused[0]} does not apply to a couplet (keywords); it takes keywords, seed "
                          "and model (POST /couplet has the couplet's own options)", unused[0], "unsupported")
    creq = CoupletRequest(keywords=keywords, seed=req.seed, model=req.model)
    server, words, ticket = _enter_line(state, creq)
    couplet = await _write(server, request, ticket, creq, words, arrival)
    return {"couplet": f"上联：{couplet['upper']}\n下联：{couplet['lower']}\n横批：{couplet['horizontal']}",
            **couplet}


def _enter_line(state: ServerState, req: CoupletRequest) -> tuple[ModelServer, list[str], Any]:
    """Checks the request, then joins the couplet line of the model that writes it: a place, a
    place in line, or a 429 whose Retry-After is the wait the line would have meant."""
    try:
        keywords = rules.split_keywords(req.keywords)
    except ValueError as exc:
        raise bad_request(str(exc), "keywords", "invalid_keywords") from None
    if req.method not in COUPLET_METHODS:
        raise bad_request(f"method={req.method!r}: expected one of {', '.join(COUPLET_METHODS)}", "method")
    if req.num_candidates is not None and req.method == "free":
        raise bad_request(f"num_candidates={req.num_candidates}: only method 'constrained' writes and reranks "
                          "candidates; 'free' writes one couplet, the model's alone", "num_candidates")
    if req.num_candidates is not None and not 1 <= req.num_candidates <= MAX_CANDIDATES:
        raise bad_request(f"num_candidates={req.num_candidates}: must be in [1, {MAX_CANDIDATES}]", "num_candidates")
    if req.seed is not None and not 0 <= req.seed <= SEED_RANGE[1]:
        raise bad_request(f"seed={req.seed}: must be in [0, 2^64 - 1]", "seed")
    server = couplet_server(state, req.model)
    if req.num_candidates is not None and req.num_candidates > server.capacity:    # retrying cannot help
        raise bad_request(f"num_candidates={req.num_candidates}: this server holds at most {server.capacity} "
                          "generations at once (max_batch_size + max_queue_size)", "num_candidates",
                          "too_many_generations")
    try:
        return server, keywords, desk(server).line.join()
    except LineFull as full:
        server.metrics.reject("queue_full")
        retry = retry_after_s(full.retry_s)
        raise APIError(429, f"too many couplets are being written: {full.reason} (max_couplet_wait_s); retry in "
                       f"{retry} s", "rate_limit_error", None, "queue_full", {"Retry-After": str(retry)}) from None


async def _write(server: ModelServer, request: Request | None, ticket: Any, req: CoupletRequest,
                 keywords: list[str], arrival: float) -> dict:
    """Waits for the ticket's turn, then runs the couplet writer's rounds on the couplet model's
    engine, next to everyone else's requests in its batches. A client that leaves while in
    line leaves it at once. `request` None: the caller watches for that (a stream)."""
    d = desk(server)
    line = d.line
    watch = ClientWatch(request) if request is not None else None
    try:
        if watch is None:
            await line.wait_for_turn(ticket)
        else:
            try:
                await watch.until_gone(line.wait_for_turn(ticket))
            except APIError:
                server.metrics.reject("left_line")
                raise
        waited = time.perf_counter() - arrival
        plan = d.writer().plan(keywords, req.seed, req.method == "constrained", req.num_candidates or d.candidates())
        try:
            jobs = next(plan)
            while True:
                prep = Prepared([j.prompt for j in jobs], [(j.prompt, j.params) for j in jobs])
                final = await run_to_end(server.open(prep, 0, arrival, False, bounded=False), None, watch)
                jobs = plan.send([final[i] for i in range(len(jobs))])
        except StopIteration as done:
            result = done.value.as_dict()
    finally:
        line.release(ticket)
        if watch is not None:
            watch.close()
    result["timing"] = {"seconds": time.perf_counter() - arrival, "waited_s": waited}
    return {"model": server.model_id, **result}


async def _events(server: ModelServer, ticket: Any, req: CoupletRequest, keywords: list[str],
                  arrival: float) -> AsyncIterator[str]:
    """The streamed couplet: its place in line when it changes (checked every second), then
    the couplet. A client that goes away cancels this; the response's background task releases
    the ticket in every case."""
    try:
        last = None
        while not ticket.turn.done():
            position = ticket.position
            if position != last:
                wait = ticket.expected_wait_s()
                last = position
                yield sse_event("queued", {"position": position,
                                           "expected_wait_s": None if wait is None else round(wait, 1)})
            await asyncio.wait({ticket.turn}, timeout=COUPLET_UPDATE_S)
        yield sse_event("writing", {"waited_s": round(time.perf_counter() - arrival, 2)})
        yield sse_event("couplet", await _write(server, None, ticket, req, keywords, arrival))
    except (APIError, RequestTimeout, EngineError, ValueError) as exc:
        yield sse_event("error", as_api_error(exc).body())


def _refine(name: str, schema: dict) -> None:
    props = schema.get("properties", {})
    if name == "GenerateRequest":       # a prompt, or the couplet guide's keywords
        props["keywords"] = {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Keywords"}
        schema["anyOf"] = [*schema.get("anyOf", []),
                           {"required": ["keywords"], "properties": {"keywords": {"not": {"type": "null"}}}}]
    if "keywords" in props:
        # at least one Chinese character (a keyword holds nothing else; the rest is separators)
        for branch in props["keywords"].get("anyOf", [props["keywords"]]):
            if branch.get("type") == "string":
                branch.update({"minLength": 1, "maxLength": rules.MAX_INPUT, "pattern": rules.cjk_class()})
    if name == "CoupletRequest":
        props["method"]["enum"] = list(COUPLET_METHODS)
        for field, bound in (("seed", {"minimum": 0, "maximum": SEED_RANGE[1]}),   # picks candidates' seeds
                             ("num_candidates", {"minimum": 1, "maximum": MAX_CANDIDATES})):
            for branch in props[field].get("anyOf", [props[field]]):
                if branch.get("type") == "integer":
                    branch.update(bound)


_COUPLET = obj({"model": STR, "upper": STR, "lower": STR, "horizontal": STR,
                 "keywords": {"type": "array", "items": STR},
                 "rules": {"type": "object", "additionalProperties": BOOL}, "all_rules_hold": BOOL,
                 "score": NUM, "constrained": BOOL, "num_candidates": INT,
                 "timing": obj({"seconds": NUM}, {"waited_s": NUM})})
SCHEMA = Extension(
    request_bodies={"/couplet": CoupletRequest},
    response_schemas={"CoupletResponse": _COUPLET,
                      "GenerateCoupletResponse": {**_COUPLET, "required": _COUPLET["required"] + ["couplet"],
                                                  "properties": {**_COUPLET["properties"], "couplet": STR}}},
    response_bodies={"/couplet": ["CoupletResponse"], "/generate": ["GenerateCoupletResponse"]},
    html_pages={"/couplet": "the couplet page (HTML)"},
    model_card={"couplets": BOOL},
    refine=_refine,
)
