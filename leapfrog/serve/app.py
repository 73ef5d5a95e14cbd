"""The HTTP core of `leapfrog serve` (FastAPI): every served model's engine thread
(engine_thread.AsyncEngine), the gate each request passes (auth, rate limit, queue), and the
endpoints POST /generate, /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET
/v1/models, /health, /healthz, /ready, /metrics. Guest apps add their own routes through
`create_app(..., guests)` (serve/main.py installs the couplet terminal); the core imports none.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from leapfrog.engine.llm_engine import LLMEngine
from leapfrog.sampling_params import ParamError, defaults_for_model
from leapfrog.serve import schema as server_schema
from leapfrog.serve.auth import AuthError, Authenticator, RateLimiter, retry_after_header
from leapfrog.serve.config import ServerConfig
from leapfrog.serve.engine_thread import AsyncEngine, EngineError, Generation, RequestTimeout
from leapfrog.serve.line import retry_after_s
from leapfrog.serve.metrics import (CONTENT_TYPE as METRICS_CONTENT_TYPE, CountResponses, HTTPResponses, ServerMetrics,
                                   render_all)
from leapfrog.serve.openai_api import (Limits, Prepared, chat_body, chat_logprobs, check_model, check_prompt,
                                    compile_constraint, completion_body, completion_logprobs, detokenize_body,
                                    echo_choice, encode_prompt, finish_reason, join_logprobs, new_id, now,
                                    prepare_chat, prepare_completion, prompt_logprobs_body, requested_constraint,
                                    sampling_params, sse, tokenize_body, usage)
from leapfrog.serve.tools import ToolStream
from leapfrog.serve.protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest, FaultRequest,
                                    GenerateRequest, TokenizeRequest, bad_request, parse_body)

log = logging.getLogger("leapfrog.serve.app")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}   # no proxy buffering


def request_defaults(cfg: ServerConfig) -> dict:
    """Sampling defaults for requests that leave fields out: the model's generation_config.json
    (temperature 0 for a greedy model such as `couplets`, 0.7 / top-p 0.9 for `stories`), under
    an explicit --default-temperature; temperature 1.0 when neither says. A malformed generation_config
    is logged, naming the file and the key, and ignored: the server still serves."""
    defaults = defaults_for_model(cfg.model, log.warning)
    if cfg.default_temperature is not None:
        defaults["temperature"] = cfg.default_temperature
    defaults.setdefault("temperature", 1.0)
    return defaults


class ModelServer:
    """One served model: its engine thread, metrics, request defaults and capacity (`cfg` is
    the model's single-model view, ServerConfig.views)."""

    def __init__(self, cfg: ServerConfig, factory: Callable[[], Any]) -> None:
        self.cfg = cfg
        self.model_id = cfg.model_id
        self.metrics = ServerMetrics(cfg.model_id)
        timeout = cfg.request_timeout or None
        places = int(cfg.engine.get("max_batch_size", 64))
        self.engine = AsyncEngine(factory, self.metrics, cfg.warmup_requests, timeout, self._after_warmup,
                                  places)
        self.capacity = places + cfg.max_queue_size
        self.sampling_defaults = request_defaults(cfg)
        self.guests: dict[str, Any] = {}    # what each guest app keeps for this model, by guest
        # requests in flight that yield to live ones (batch lines: aborted when live work comes),
        # so they never count against a live request's admission
        self.num_background = 0
        self.warmup_hooks: list[Callable[[], None]] = []   # the guests' preparations before /ready

    def limits(self) -> Limits:
        info = self.engine.info
        return Limits({self.cfg.model_id, str(self.cfg.model)}, info.max_model_len, info.vocab_size,
                      self.cfg.default_max_tokens, self.sampling_defaults, self.cfg.max_n,
                      info.max_prompt_chars, info.method, info.constrains, info.scores_prompt)

    def check_ready(self) -> None:
        if not self.engine.ready.is_set():
            doing = "is restarting after an engine failure" if self.engine.restarting else "is still loading"
            raise APIError(503, f"model {self.model_id!r} {doing}", "server_error", None, "not_ready",
                           {"Retry-After": "5"})

    def queue_wait_s(self, num: int) -> float | None:
        """Expected seconds before the last of `num` new requests would start running: 0 while
        the batch has room, else its place in the engine's queue over the measured drain rate
        (None while that is unknown)."""
        queued = self.num_live + num - self.engine.places
        return 0.0 if queued <= 0 else self.engine.drain.wait_s(queued)

    def open(self, prep: Prepared, priority: int, arrival: float, stream: bool, bounded: bool = True) -> Generation:
        """Queue the prepared requests, or answer 429 when they would not fit the queue
        (max_queue_size) or, `bounded`, not start within max_queue_wait_s."""
        num = len(prep.requests)
        if num > self.capacity:     # retrying can never help: not a 429
            raise bad_request(f"this request asks for {num} generations (n x prompts) but the "
                              f"server holds at most {self.capacity} at once (max_batch_size + max_queue_size)",
                              "n", "too_many_generations")
        wait = self.queue_wait_s(num)
        if self.num_live + num > self.capacity:
            why = f"the queue is full ({self.num_live} requests in flight, max_queue_size)"
        elif bounded and wait is not None and wait > self.cfg.max_queue_wait_s:
            why = (f"the queue would hold this request about {wait:.0f} s, more than max_queue_wait_s "
                   f"({self.cfg.max_queue_wait_s:g} s)")
        else:
            return Generation(self.engine, prep.requests, priority, arrival, stream)
        self.metrics.reject("queue_full")
        retry = retry_after_s(wait)
        raise APIError(429, f"server is busy: {why}; retry in {retry} s", "rate_limit_error", None, "queue_full",
                       {"Retry-After": str(retry)})

    @property
    def num_live(self) -> int:
        return self.engine.num_in_flight - self.num_background

    def _after_warmup(self) -> None:
        """In the engine thread after its warm-up, before /ready: the guests' preparations."""
        for hook in self.warmup_hooks:
            hook()


class ServerState:
    """Everything the handlers share; one per app. `models` holds one ModelServer per served
    model (by id, and by the path or name it was loaded from); `primary` serves requests that
    name no model. `engine`, `metrics` and `capacity` are the primary's."""

    def __init__(self, cfg: ServerConfig, factory: Callable[[], Any] | None = None) -> None:
        self.cfg = cfg
        servers = [ModelServer(view, factory if i == 0 and factory is not None else model_engine_factory(view))
                   for i, view in enumerate(cfg.views())]
        self.servers = servers
        self.primary = servers[0]
        self.models: dict[str, ModelServer] = {}
        for m in servers:
            self.models.setdefault(m.model_id, m)
            self.models.setdefault(str(m.cfg.model), m)
        self.auth = Authenticator(cfg.api_key, cfg.api_key_file, cfg.jwt_secret)
        self.limiter = RateLimiter(cfg.rate_limit, cfg.rate_limit_burst)
        self.started = time.time()
        self.draining = False
        self.responses = HTTPResponses()
        # What guest apps (serve/couplet.py) add: fields of /v1/models' cards, other forms of
        # POST /generate (a body with this field, not null, goes to the handler), OpenAPI entries.
        self.model_card_fields: list[Callable[[ModelServer], dict]] = []
        self.generate_variants: dict[str, Callable[..., Awaitable[Any]]] = {}
        self.schema_extensions: list[server_schema.Extension] = []
        self.background: list[Callable[[], Awaitable[None]]] = []   # guests' tasks while the server runs

    @property
    def engine(self) -> AsyncEngine:
        return self.primary.engine

    @property
    def metrics(self) -> ServerMetrics:
        return self.primary.metrics

    @property
    def capacity(self) -> int:
        return self.primary.capacity

    def route(self, name: str | None) -> ModelServer:
        """The server of the model a request names (None: the primary), ready to take it."""
        server = self.primary if name is None else self.models.get(name)
        if server is None:
            ids = ", ".join(repr(m.model_id) for m in self.servers)
            raise APIError(404, f"the model {name!r} does not exist; this server serves {ids}",
                           "invalid_request_error", "model", "model_not_found")
        server.check_ready()
        return server

    # --- the gate every generation request passes ------------------------------------------
    def authenticate(self, request: Request) -> str | None:
        try:
            return self.auth.check(request.headers.get("authorization"), request.headers.get("x-api-key"))
        except AuthError as exc:
            self.primary.metrics.reject("unauthorized", routed=False)
            raise APIError(401, str(exc), "authentication_error", None, "invalid_api_key",
                           {"WWW-Authenticate": "Bearer"}) from None

    def admit(self, request: Request) -> None:
        identity = self.authenticate(request)
        if self.draining:
            raise APIError(503, "server is shutting down", "server_error", None, "shutting_down",
                           {"Retry-After": "5", "Connection": "close"})
        if all(m.num_live >= m.capacity for m in self.servers):
            # Every model is full: no body this request could send would be admitted. Answer
            # before reading and tokenizing it, so that a burst is turned away at once and
            # the admitted requests keep the CPU.
            self.primary.metrics.reject("queue_full", routed=False)
            retry = min(retry_after_s(m.queue_wait_s(1)) for m in self.servers)
            raise APIError(429, f"server is at capacity; retry in {retry} s", "rate_limit_error", None, "queue_full",
                           {"Retry-After": str(retry)})
        client = identity or (request.client.host if request.client else "unknown")
        wait = self.limiter.acquire(client)
        if wait > 0:
            self.primary.metrics.reject("rate_limited", routed=False)
            raise APIError(429, f"rate limit of {self.limiter.rate:g} requests/s exceeded; retry in "
                           f"{wait:.1f}s", "rate_limit_error", None, "rate_limit_exceeded",
                           {"Retry-After": retry_after_header(wait)})


def model_engine_factory(cfg: ServerConfig) -> Callable[[], Any]:
    def factory() -> Any:
        # deferred: the rank launcher (multiprocessing, torch.distributed) loads only when a model is built
        from leapfrog.engine.distributed import num_ranks, start
        if num_ranks(cfg.engine) > 1:       # this process drives; the follower ranks are started here
            return start(str(cfg.model), cfg.engine_kwargs())
        return LLMEngine(cfg.model, **cfg.engine_kwargs())
    return factory


# Open even with authentication on: the orchestrator's liveness and readiness probes, which
# answer a status word and nothing else. /health (model ids, errors, restarts) needs the key.
PROBE_PATHS = frozenset({"/healthz", "/ready"})
# Open to GET and HEAD too: the pages (static HTML that holds no data), so that a browser can
# open them and the key box on each can send the key with the page's own requests.
PAGE_PATHS = frozenset({"/", "/couplet"})
OFF_LOOP_BYTES = 64 << 10     # bodies this large are parsed and tokenized in a worker thread


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes (by Content-Length before reading,
    else while reading), and with 415 unless it is JSON: a browser may send text/plain or a form
    from any web page without asking first (no CORS preflight), JSON it may not."""
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype and ctype != "application/json" and not ctype.endswith("+json"):
        raise APIError(415, f"Content-Type must be application/json, not {ctype!r} (curl: add "
                       "-H 'Content-Type: application/json')", "invalid_request_error", None,
                       "unsupported_media_type")
    too_big = APIError(413, f"request body is larger than the server's limit of {limit} bytes "
                       "(max_body_bytes)", "invalid_request_error", None, "body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:
        # Not the server's fault (a flaky client, a proxy giving up): 499 as nginx and vLLM count it.
        raise client_closed() from None
    return b"".join(chunks)


def client_closed() -> APIError:
    return APIError(499, "client closed the connection", "invalid_request_error", None, "client_closed")


class ClientWatch:
    """Notices at once when the client of a request whose body has been read goes away (its
    ASGI `http.disconnect`), with no polling: `gone` resolves then. close() when the answer is
    ready, before sending it."""

    def __init__(self, request: Request) -> None:
        self.gone: asyncio.Future = asyncio.ensure_future(self._watch(request.receive))

    @staticmethod
    async def _watch(receive: Callable) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def until_gone(self, awaitable: Any) -> Any:
        """`awaitable`'s result, or a 499 (and `awaitable` cancelled) if the client leaves first."""
        task = asyncio.ensure_future(awaitable)
        await asyncio.wait({task, self.gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise client_closed()

    def close(self) -> None:
        self.gone.cancel()


async def off_loop_if_big(size: int, fn: Callable, *args: Any) -> Any:
    """Parsing and tokenizing a large body takes long enough to stall every other client's
    stream if done on the event loop; a small one is cheaper inline than a thread hop."""
    if size > OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


class RequireAuth:
    """With authentication on, every endpoint but the probes and the pages needs it: /metrics, /docs and
    /openapi.json too (the generation routes check again, for the caller's identity). Plain
    ASGI rather than @app.middleware, which would copy every streamed chunk through a queue."""

    def __init__(self, app: Any, state: "ServerState") -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in PROBE_PATHS and not (
                scope["path"] in PAGE_PATHS and scope.get("method") in ("GET", "HEAD")):
            try:
                self.state.authenticate(Request(scope))
            except APIError as exc:
                await exc.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestTimeout):
        return APIError(504, str(exc), "timeout_error", None, "request_timeout")
    if isinstance(exc, ParamError):
        return bad_request(str(exc), exc.field)
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    return APIError(500, f"internal error: {exc}", "server_error", None, "internal_error")


async def run_to_end(gen: Generation, request: Request | None, watch: ClientWatch | None = None) -> dict[int, Any]:
    """Non-streaming: the final output of every choice. A client that hangs up is noticed at
    once (queued or decoding) and its requests are aborted. `request` None: the caller watches
    (a streamed response, cancelled when its client goes)."""
    own = watch is None and request is not None
    if own:
        watch = ClientWatch(request)
    final: dict[int, Any] = {}
    try:
        async for i, out in gen.outputs(watch.gone if watch is not None else None):
            if out.finished:
                final[i] = out
    except (RequestTimeout, EngineError, ValueError) as exc:
        raise as_api_error(exc) from None
    finally:
        gen.close()
        if own:
            watch.close()
    if len(final) < gen.num_requests:       # the client hung up; nobody will read this
        raise client_closed()
    return final


def sse_response(chunks: AsyncIterator[str], gen: Generation) -> StreamingResponse:
    # The background task closes the generation even if streaming never started.
    return StreamingResponse(chunks, media_type="text/event-stream", headers=SSE_HEADERS,
                             background=BackgroundTask(gen.close))


async def stream_events(gen: Generation, render: Callable[[int, Any], dict | None],
                        tail: Callable[[], list[dict]]) -> AsyncIterator[str]:
    """SSE frames: one per output that says something, `tail()` frames, then [DONE]. An
    error after the headers went out can only be reported in-band."""
    try:
        async for i, out in gen.outputs():
            chunk = render(i, out)
            if chunk is not None:
                yield sse(chunk)
        for chunk in tail():
            yield sse(chunk)
    except (RequestTimeout, EngineError, ValueError) as exc:
        yield sse(as_api_error(exc).body())
    finally:
        gen.close()
    yield sse("[DONE]")


# --- app -------------------------------------------------------------------------------------
def create_app(cfg: ServerConfig, engine_factory: Callable[[], Any] | None = None,
               guests: Sequence[Callable[[FastAPI, ServerState], None]] = ()) -> FastAPI:
    """The HTTP core, then each guest's `install(app, state)`; `engine_factory` (tests) replaces
    the first served model's engine. `leapfrog serve` (serve/main.py) installs the couplet terminal."""
    state = ServerState(cfg, engine_factory)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for m in state.servers:
            m.engine.start(asyncio.get_running_loop())
        supervisors = [asyncio.create_task(m.engine.supervise()) for m in state.servers]
        supervisors += [asyncio.create_task(work()) for work in state.background]
        yield
        state.draining = True     # uvicorn has already waited for in-flight requests
        for task in supervisors:
            task.cancel()
        await asyncio.gather(*(asyncio.to_thread(m.engine.stop) for m in state.servers))

    app = FastAPI(title="leapfrog", lifespan=lifespan)
    app.state.leapfrog = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and wrong methods get the same error shape as everything else.
        headers = exc.headers
        if exc.status_code == 405:      # starlette names the first route's methods; a path may have several
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(app, request.url.path))}
        return APIError(exc.status_code, str(exc.detail), "invalid_request_error", None,
                        "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405
                        else None, headers).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return as_api_error(exc).response()

    if state.auth.enabled:
        app.add_middleware(RequireAuth, state=state)
    if cfg.cors_allow_origins:      # off by default: a page elsewhere cannot read the answers
        from starlette.middleware.cors import CORSMiddleware     # deferred: only when CORS is configured
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.cors_allow_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-API-Key"], max_age=600,
                           expose_headers=["Retry-After"])     # a 429's wait, readable by the page
    app.add_middleware(CountResponses, counter=state.responses)     # outermost: sees every response
    _add_probe_routes(app, state)
    _add_generate_route(app, state)
    _add_openai_routes(app, state)
    if cfg.fault_injection:
        _add_fault_route(app, state)
    server_schema.install(app, state.auth.enabled, cfg.max_n, state.schema_extensions)
    for install in guests:
        install(app, state)
    return app


def _allowed_methods(app: FastAPI, path: str) -> list[str]:
    return sorted({m for r in app.routes if getattr(r, "path", None) == path for m in (getattr(r, "methods", None) or ())})


def _add_probe_routes(app: FastAPI, state: ServerState) -> None:
    engines = [m.engine for m in state.servers]

    def probe(path: str) -> Callable:
        """GET, and HEAD for probes that read only the status: two routes, so that each operation
        has its own operationId in the OpenAPI document."""
        def register(fn: Callable) -> Callable:
            app.add_api_route(path, fn, methods=["GET"])
            app.add_api_route(path, fn, methods=["HEAD"], name=f"{fn.__name__}_head")
            return fn
        return register

    @probe("/health")
    async def health() -> JSONResponse:
        for m in state.servers:
            e = m.engine
            if e.load_error is not None or e.restarting or (e.ready.is_set() and not e.alive):
                status = "unhealthy" if e.load_error is not None else "restarting"
                return JSONResponse({"status": status, "model": m.model_id,
                                     "error": str(e.load_error or "the engine loop died; it is being rebuilt"),
                                     "restarts": e.restarts, "uptime": time.time() - state.started},
                                    status_code=503)
        ready = all(e.ready.is_set() for e in engines) and not state.draining
        return JSONResponse({"status": "healthy", "uptime": time.time() - state.started, "ready": ready,
                             "model": state.primary.model_id, "models": [m.model_id for m in state.servers]})

    @probe("/healthz")
    async def healthz() -> JSONResponse:
        """Liveness: the process answers and every engine runs, loads, or is being restarted by
        its supervisor (a restart is recovery in progress, not a reason to kill the process)."""
        ok = all(e.load_error is None for e in engines)
        return JSONResponse({"status": "ok" if ok else "dead"}, status_code=200 if ok else 503)

    @probe("/ready")
    async def ready() -> JSONResponse:
        """Readiness: every model loaded and warmed up, and not draining for shutdown."""
        status = ("failed" if any(e.load_error is not None for e in engines) else "draining" if state.draining
                  else "ready" if all(e.ready.is_set() for e in engines)
                  else "restarting" if any(e.restarting for e in engines) else "loading")
        return JSONResponse({"status": status}, status_code=200 if status == "ready" else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_all([m.metrics for m in state.servers], (state.responses,)),
                                 media_type=METRICS_CONTENT_TYPE)

    def card(m: ModelServer) -> dict:
        return {"id": m.model_id, "object": "model", "created": int(state.started), "owned_by": "leapfrog",
                "max_model_len": m.engine.info.max_model_len, "method": m.engine.info.method,
                **{k: v for fields in state.model_card_fields for k, v in fields(m).items()}}

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        state.authenticate(request)
        return JSONResponse({"object": "list", "data": [card(m) for m in state.servers]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> JSONResponse:
        """One model's card (OpenAI's models.retrieve), or 404 naming the models served."""
        state.authenticate(request)
        server = state.models.get(model)
        if server is None:
            ids = ", ".join(repr(m.model_id) for m in state.servers)
            raise APIError(404, f"the model {model!r} does not exist; this server serves {ids}",
                           "invalid_request_error", "model", "model_not_found")
        return JSONResponse(card(server))


def _add_generate_route(app: FastAPI, state: ServerState) -> None:
    @app.post("/generate")
    async def generate(request: Request) -> Any:
        """The simple contract: prompt + max_tokens (or max_length) -> text, counts, timing."""
        arrival = time.perf_counter()
        state.admit(request)
        raw = await read_body(request, state.cfg.max_body_bytes)
        variant, raw = _generate_variant(state, raw)
        if variant is not None:
            return await variant[0](state, request, variant[1], arrival)
        req = await off_loop_if_big(len(raw), parse_body, raw, GenerateRequest)
        if req.prompt is None:
            raise bad_request("missing required field 'prompt'", "prompt", "missing_field")
        server = state.route(req.model)
        prep = await off_loop_if_big(len(raw), _prepare_generate, req, server.limits(), server.engine.tokenizer)
        ids = prep.prompts[0]
        gen = server.open(prep, req.priority, arrival, req.stream)
        if req.stream:
            def render(i: int, out: Any) -> dict | None:
                if not out.delta_text and not out.finished:
                    return None
                return {"text": out.delta_text, "num_tokens": len(out.token_ids),
                        "finished": out.finished, "finish_reason": finish_reason(out)}
            return sse_response(stream_events(gen, render, lambda: []), gen)
        out = (await run_to_end(gen, request))[0]
        total = time.perf_counter() - arrival
        m = out.metrics
        return {"text": out.text, "model": server.model_id, "num_tokens": len(out.token_ids),
                "prompt_tokens": len(ids), "finish_reason": finish_reason(out),
                "tokens_per_forward": m.tokens_per_forward,
                "timing": {"total_s": total, "time_to_first_token_s": m.time_to_first_token,
                           "tokens_per_s": len(out.token_ids) / total if total > 0 else 0.0}}


def _generate_variant(state: ServerState, raw: bytes) -> tuple[tuple[Callable, dict] | None, bytes]:
    """A guest's form of /generate that this body takes (its field set, not null): (handler, the
    parsed body), else None and the body (without the guests' fields where they are null)."""
    # A look at the bytes spares most bodies a second parse; a key may be written with escapes
    # ("key\u0077ords"), so a body holding any is parsed to see.
    if b"\\" not in raw and not any(f'"{f}"'.encode() in raw for f in state.generate_variants):
        return None, raw
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, raw                  # parse_body gives the 400
    if not isinstance(body, dict):
        return None, raw
    fields = [f for f in state.generate_variants if f in body]
    for f in fields:
        if body.get(f) is not None:
            return (state.generate_variants[f], body), raw
    if any(f in body for f in fields):
        return None, json.dumps({k: v for k, v in body.items() if k not in fields}).encode()
    return None, raw


def _add_fault_route(app: FastAPI, state: ServerState) -> None:
    @app.post("/admin/fault", status_code=202)
    async def fault(request: Request) -> JSONResponse:
        """Fault injection (--fault-injection only): `{"fault": "engine_crash", "model"?: id}` makes
        that model's engine loop die at its next turn; its supervisor fails the requests in flight
        and rebuilds it. For recovery drills and the reliability benchmark."""
        state.authenticate(request)
        body = parse_body(await read_body(request, state.cfg.max_body_bytes), FaultRequest)
        if body.fault != "engine_crash":
            raise bad_request(f"fault={body.fault!r}: the only fault is 'engine_crash'", "fault")
        server = state.route(body.model)
        log.warning("fault injection: crashing the engine of %s", server.model_id)
        server.engine.inject_crash()
        return JSONResponse({"fault": body.fault, "model": server.model_id}, status_code=202)


def _prepare_generate(req: GenerateRequest, limits: Limits, tok: Any) -> Prepared:
    check_model(req.model, limits)
    if req.max_tokens is not None and req.max_length not in (None, req.max_tokens):
        raise bad_request("max_tokens and max_length disagree", "max_length")
    ids = encode_prompt(req.prompt, tok, limits)
    check_prompt(ids, limits)
    max_tokens = req.max_tokens if req.max_tokens is not None else req.max_length
    constraint = requested_constraint(req)
    compile_constraint(constraint, tok, limits)
    return Prepared([ids], [(ids, sampling_params(req, limits, len(ids), max_tokens, constraint=constraint))])


def parse_and_prepare(raw: bytes, kind: type, prepare: Callable, state: ServerState
                       ) -> tuple[Any, ModelServer, Prepared]:
    """Parse the body, route it to the model it names, tokenize and check it there."""
    req = parse_body(raw, kind)
    server = state.route(req.model)
    return req, server, prepare(req, server.limits(), server.engine.tokenizer)


def _add_openai_routes(app: FastAPI, state: ServerState) -> None:
    # Completions and chat differ only in their request type, prompt preparation and
    # response shapes; one handler body serves both.
    async def handle(request: Request, kind: type, prepare: Callable, stream: Callable,
                     body: Callable, id_prefix: str) -> Any:
        arrival = time.perf_counter()
        state.admit(request)
        raw = await read_body(request, state.cfg.max_body_bytes)
        req, server, prep = await off_loop_if_big(len(raw), parse_and_prepare, raw, kind, prepare, state)
        tok = server.engine.tokenizer
        gen = server.open(prep, req.priority, arrival, req.stream)
        rid, created, model = new_id(id_prefix), now(), server.model_id
        if req.stream:
            return sse_response(stream(gen, req, prep, tok, rid, created, model), gen)
        final = await run_to_end(gen, request)
        return body(final, req, prep, tok, rid, created, model)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, CompletionRequest, prepare_completion, _stream_completion,
                            completion_body, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await handle(request, ChatRequest, prepare_chat, _stream_chat, chat_body, "chatcmpl")

    # vLLM's tokenizer endpoints: no engine work, so no queue; authenticated like the rest.
    async def tokenizer_call(request: Request, kind: type, body: Callable) -> Any:
        state.authenticate(request)
        raw = await read_body(request, state.cfg.max_body_bytes)
        _, _, out = await off_loop_if_big(len(raw), parse_and_prepare, raw, kind, body, state)
        return out

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        return await tokenizer_call(request, TokenizeRequest, tokenize_body)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        return await tokenizer_call(request, DetokenizeRequest, detokenize_body)


def sse_event(name: str, data: dict) -> str:
    return f"event: {name}\n{sse(data)}"


def _context(out: Any, num_sent: int) -> tuple[list[int], list[int]]:
    """Token ids before the first logprob entry not yet streamed: the prompt, the output sent."""
    return out.prompt_token_ids, [e["token_id"] for e in out.logprobs[:num_sent]]


def usage_tail(req: Any, head: dict, prep: Prepared, counts: list[int], lasts: list) -> Callable[[], list[dict]]:
    """The stream's last chunk when the client asked for usage (stream_options.include_usage);
    `lasts`: each choice's latest output."""
    def tail() -> list[dict]:
        if req.stream_options and req.stream_options.include_usage:
            return [{**head, "choices": [], "usage": usage(prep, sum(counts), lasts)}]
        return []
    return tail


def _stream_completion(gen: Generation, req: CompletionRequest, prep: Prepared, tok: Any,
                       rid: str, created: int, model: str) -> AsyncIterator[str]:
    n = len(prep.requests)
    sent_lp, offsets, counts, started, lasts = [0] * n, [0] * n, [0] * n, [False] * n, [None] * n
    sent_ids = [0] * n
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}

    scoring = req.max_tokens == 0      # echo only: the one decoded token is left out

    def render(i: int, out: Any) -> dict | None:
        counts[i] = 0 if scoring else len(out.token_ids)
        lasts[i] = out
        first = not started[i]
        # a choice's first chunk starts with the echoed prompt (and its logprobs)
        head_text, head_lp = echo_choice(out, req, prep, tok, i) if first else ("", None)
        offsets[i] += len(head_text)
        lp = None
        if req.logprobs is not None and out.logprobs and not scoring:
            lp = completion_logprobs(out.logprobs[sent_lp[i]:], tok, offsets[i], *_context(out, sent_lp[i]))
            sent_lp[i] = len(out.logprobs)
            offsets[i] += sum(len(t) for t in lp["tokens"])
        lp = join_logprobs(head_lp, lp)
        delta = "" if scoring else out.delta_text
        if not delta and not head_text and not out.finished and lp is None and not (
                first and req.prompt_logprobs is not None):
            return None
        started[i] = True
        choice = {"index": i, "text": head_text + delta, "logprobs": lp, "finish_reason": finish_reason(out)}
        if first and req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_body(out.prompt_logprobs or [], out.prompt_token_ids,
                                                             tok, req.prompt_logprobs)
        if req.return_token_ids:     # the prompt's ids in a choice's first chunk; new ids in each
            if first:
                choice["prompt_token_ids"] = out.prompt_token_ids
            choice["token_ids"] = [] if scoring else out.token_ids[sent_ids[i]:]
            sent_ids[i] = len(out.token_ids)
        return {**head, "choices": [choice]}

    return stream_events(gen, render, usage_tail(req, head, prep, counts, lasts))


def _stream_chat(gen: Generation, req: ChatRequest, prep: Prepared, tok: Any,
                 rid: str, created: int, model: str) -> AsyncIterator[str]:
    n = len(prep.requests)
    sent_lp, counts, started, lasts = [0] * n, [0] * n, [False] * n, [None] * n
    sent_ids = [0] * n
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    tools = [ToolStream(prep.tools) for _ in range(n)]

    def render(i: int, out: Any) -> dict | None:
        counts[i] = len(out.token_ids)
        lasts[i] = out
        lp = None
        if req.logprobs and out.logprobs:
            lp = chat_logprobs(out.logprobs[sent_lp[i]:], tok, *_context(out, sent_lp[i]))
            sent_lp[i] = len(out.logprobs)
        text, calls, called = tools[i].feed(out.delta_text, out.finished and out.finish_reason != "abort")
        if not text and not calls and not out.finished and lp is None:
            return None
        delta: dict[str, Any] = {"content": text} if text or not calls else {}
        if calls:
            delta["tool_calls"] = calls
        reason = "tool_calls" if called and out.finish_reason == "stop" else finish_reason(out)
        chunk = {**head}
        if not started[i]:          # OpenAI streams announce the role in a choice's first delta
            delta, started[i] = {"role": "assistant", **delta}, True
            if i == 0 and req.prompt_logprobs is not None:     # vLLM's, once for the request
                chunk["prompt_logprobs"] = prompt_logprobs_body(out.prompt_logprobs or [], out.prompt_token_ids,
                                                                tok, req.prompt_logprobs)
            if i == 0 and req.return_token_ids:
                chunk["prompt_token_ids"] = out.prompt_token_ids
        choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
        if req.return_token_ids:
            choice["token_ids"] = out.token_ids[sent_ids[i]:]
            sent_ids[i] = len(out.token_ids)
        return {**chunk, "choices": [choice]}

    return stream_events(gen, render, usage_tail(req, head, prep, counts, lasts))


# --- command line ----------------------------------------------------------------------------
