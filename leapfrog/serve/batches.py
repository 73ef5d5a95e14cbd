"""Batch jobs: OpenAI's Batch API on the server and `leapfrog run-batch`, stored in SQLite.

Each input line (vLLM's run-batch format) is answered exactly as its endpoint would answer it;
its result is stored in the transaction that marks it done, so a crash loses nothing finished.
Batch lines run at background priority and yield to live requests. Files and batches belong to
the API key that made them (another key gets 404). (docs/decisions.md, "Batch jobs")
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from leapfrog.sampling_params import BACKGROUND_PRIORITY
from leapfrog.serve.app import parse_and_prepare, read_body, run_to_end
from leapfrog.serve.engine_thread import Generation
from leapfrog.serve.openai_api import (chat_body, completion_body, new_id as response_id, now, prepare_chat,
                                       prepare_completion)
from leapfrog.serve.protocol import APIError, ChatRequest, CompletionRequest, bad_request

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
WINDOW = "24h"                           # OpenAI's only completion window
WINDOW_S = 24 * 3600
BATCH_PRIORITY = BACKGROUND_PRIORITY     # after every live request (lower runs first); short loop calls
LIVE_POLL_S = 0.05          # how often the runner looks for a quiet moment to start lines in
STATUS_POLL_S = 0.5         # how often it reads the batch's status (cancelled?) from the store
LIVE_QUIET_S = 0.1          # batch lines start on a model only after this long without live requests
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL,
    filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, owner TEXT NOT NULL, status TEXT NOT NULL,
    created_at INTEGER NOT NULL, obj TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lines (batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT,
    request TEXT, state TEXT NOT NULL, result TEXT, is_error INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, idx));
CREATE INDEX IF NOT EXISTS lines_pending ON lines (batch_id, state);
CREATE TABLE IF NOT EXISTS batch_runner (batch_id TEXT PRIMARY KEY, server TEXT NOT NULL);
"""


def default_data_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "leapfrog" / "batches"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}" if prefix == "batch_req" else f"{prefix}_{uuid.uuid4().hex[:24]}"


# --- lines -------------------------------------------------------------------------------------
@dataclass(slots=True)
class Line:
    idx: int
    custom_id: str | None
    url: str | None = None
    body: dict | None = None
    error: dict | None = None              # a malformed line: its error object


def parse_lines(data: bytes, endpoint: str | None, max_lines: int) -> list[Line]:
    """The input file's lines (blank ones skipped); a malformed line carries its error. Raises
    ValueError when the file is not UTF-8 text or has more than max_lines lines."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"the input file is not UTF-8 text ({exc})") from None
    # JSONL lines end at "\n" alone: a JSON string may hold U+2028 or U+0085 as written, which
    # str.splitlines() would cut at; errors name a line by its number in the file
    raw_lines = [(number, ln) for number, ln in enumerate(text.split("\n"), 1) if ln.strip()]
    if len(raw_lines) > max_lines:
        raise ValueError(f"the input file has {len(raw_lines)} lines; at most {max_lines} are accepted")
    out, seen = [], set()
    for i, (number, raw) in enumerate(raw_lines):
        out.append(_parse_line(i, number, raw.removesuffix("\r"), endpoint, seen))
    return out


def _parse_line(i: int, number: int, raw: str, endpoint: str | None, seen: set) -> Line:
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        return Line(i, None, error={"code": "invalid_json", "message": f"line {number} is not JSON: {exc}"})
    if not isinstance(obj, dict):
        return Line(i, None, error={"code": "invalid_request", "message": f"line {number} is not a JSON object"})
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return Line(i, None, error={"code": "missing_custom_id", "message": f"line {number}: custom_id must be a "
                                    "non-empty string"})
    if cid in seen:
        return Line(i, cid, error={"code": "duplicate_custom_id", "message": f"line {number}: custom_id {cid!r} "
                                   "is used by an earlier line"})
    seen.add(cid)
    method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
    if method != "POST":
        return Line(i, cid, error={"code": "invalid_method", "message": f"line {number}: method must be POST"})
    if url not in ENDPOINTS or (endpoint is not None and url != endpoint):
        want = endpoint or " or ".join(ENDPOINTS)
        return Line(i, cid, error={"code": "invalid_url", "message": f"line {number}: url {url!r} is not {want}"})
    if not isinstance(body, dict):
        return Line(i, cid, error={"code": "invalid_body", "message": f"line {number}: body must be a JSON object"})
    if body.get("stream"):
        return Line(i, cid, error={"code": "invalid_body", "message": f"line {number}: a batch line cannot stream"})
    return Line(i, cid, url, body)


def result_line(custom_id: str | None, status: int | None, body: dict | None, error: dict | None = None) -> dict:
    """One line of an output or error file (OpenAI's shape)."""
    response = None if status is None else {"status_code": status, "request_id": new_id("req"), "body": body}
    return {"id": new_id("batch_req"), "custom_id": custom_id, "response": response, "error": error}


# --- the store ---------------------------------------------------------------------------------
class BatchStore:
    """Files, batches and lines in one SQLite database (WAL: a reader never waits for the
    writer; a transaction committed before a crash survives it)."""

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def transaction(self):
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # files
    def add_file(self, owner: str, purpose: str, filename: str, content: bytes) -> dict:
        fid, created = new_id("file"), int(time.time())
        with self.transaction() as db:
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (fid, owner, purpose, filename, len(content), created, content))
        return file_object(fid, purpose, filename, len(content), created)

    def file(self, owner: str, fid: str, content: bool = False) -> tuple[dict, bytes | None] | None:
        with self.lock:
            row = self.db.execute(f"SELECT id, purpose, filename, bytes, created_at{', content' if content else ''} "
                                  "FROM files WHERE id = ? AND owner = ?", (fid, owner)).fetchone()
        if row is None:
            return None
        return file_object(*row[:5]), (bytes(row[5]) if content else None)

    def files(self, owner: str) -> list[dict]:
        with self.lock:
            rows = self.db.execute("SELECT id, purpose, filename, bytes, created_at FROM files WHERE owner = ? "
                                   "ORDER BY created_at DESC, id", (owner,)).fetchall()
        return [file_object(*r) for r in rows]

    def count_files(self, owner: str) -> int:
        with self.lock:
            return self.db.execute("SELECT COUNT(*) FROM files WHERE owner = ?", (owner,)).fetchone()[0]

    def delete_file(self, owner: str, fid: str) -> bool:
        with self.transaction() as db:
            return db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (fid, owner)).rowcount > 0

    # batches
    def create_batch(self, owner: str, input_file_id: str, endpoint: str, lines: list[Line],
                     metadata: dict | None, bid: str | None = None, server: str | None = None) -> dict:
        """`server`: the server that runs the batch (another server sharing the store leaves it)."""
        bid, now = bid or new_id("batch"), int(time.time())
        obj = {"id": bid, "object": "batch", "endpoint": endpoint, "errors": None, "input_file_id": input_file_id,
               "completion_window": WINDOW, "status": "in_progress", "output_file_id": None, "error_file_id": None,
               "created_at": now, "in_progress_at": now, "expires_at": now + WINDOW_S, "finalizing_at": None,
               "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
               "cancelled_at": None, "metadata": metadata}
        with self.transaction() as db:
            db.execute("INSERT INTO batches VALUES (?, ?, ?, ?, ?)", (bid, owner, "in_progress", now, json.dumps(obj)))
            if server is not None:
                db.execute("INSERT INTO batch_runner VALUES (?, ?)", (bid, server))
            db.executemany("INSERT INTO lines VALUES (?, ?, ?, ?, ?, ?, ?)", [
                (bid, ln.idx, ln.custom_id, None if ln.error else json.dumps({"url": ln.url, "body": ln.body}),
                 "done" if ln.error else "pending",
                 json.dumps(result_line(ln.custom_id, None, None, ln.error)) if ln.error else None,
                 1 if ln.error else 0) for ln in lines])
        return self.batch(owner, bid)

    def batch(self, owner: str | None, bid: str) -> dict | None:
        with self.lock:
            row = self.db.execute("SELECT obj, owner FROM batches WHERE id = ?", (bid,)).fetchone()
            if row is None or (owner is not None and row[1] != owner):
                return None
            counts = self.db.execute("SELECT COUNT(*), SUM(state = 'done' AND is_error = 0), "
                                     "SUM(state = 'done' AND is_error = 1) FROM lines WHERE batch_id = ?",
                                     (bid,)).fetchone()
        obj = json.loads(row[0])
        obj["request_counts"] = {"total": counts[0], "completed": counts[1] or 0, "failed": counts[2] or 0}
        return obj

    def owner_of(self, bid: str) -> str | None:
        with self.lock:
            row = self.db.execute("SELECT owner FROM batches WHERE id = ?", (bid,)).fetchone()
        return None if row is None else row[0]

    def batches(self, owner: str, after: str | None, limit: int) -> list[dict]:
        with self.lock:
            rows = self.db.execute("SELECT id, created_at FROM batches WHERE owner = ? ORDER BY created_at DESC, id DESC",
                                   (owner,)).fetchall()
        ids = [r[0] for r in rows]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1:]
        return [self.batch(owner, b) for b in ids[:limit]]

    def update(self, bid: str, **fields: Any) -> None:
        """Set fields of the batch object (and its status column) in one transaction."""
        with self.transaction() as db:
            obj = json.loads(db.execute("SELECT obj FROM batches WHERE id = ?", (bid,)).fetchone()[0])
            obj.update(fields)
            db.execute("UPDATE batches SET obj = ?, status = ? WHERE id = ?", (json.dumps(obj), obj["status"], bid))

    def unfinished(self, server: str | None = None) -> list[str]:
        """The batches not yet done; with `server`, those it runs (and any no server claimed)."""
        mine = "" if server is None else \
            " AND id NOT IN (SELECT batch_id FROM batch_runner WHERE server != ?)"
        with self.lock:
            rows = self.db.execute(f"SELECT id FROM batches WHERE status IN ({','.join('?' * len(UNFINISHED))})"
                                   f"{mine} ORDER BY created_at, id",
                                   UNFINISHED + (() if server is None else (server,))).fetchall()
        return [r[0] for r in rows]

    def status(self, bid: str) -> str:
        with self.lock:
            return self.db.execute("SELECT status FROM batches WHERE id = ?", (bid,)).fetchone()[0]

    def pending(self, bid: str) -> list[tuple[int, str, dict]]:
        with self.lock:
            rows = self.db.execute("SELECT idx, custom_id, request FROM lines WHERE batch_id = ? AND state = 'pending' "
                                   "ORDER BY idx", (bid,)).fetchall()
        return [(i, c, json.loads(r)) for i, c, r in rows]

    def finish_line(self, bid: str, idx: int, result: dict, is_error: bool) -> bool:
        """Record a line's result, once: False when it was already done."""
        with self.transaction() as db:
            return db.execute("UPDATE lines SET state = 'done', result = ?, is_error = ? WHERE batch_id = ? "
                              "AND idx = ? AND state = 'pending'",
                              (json.dumps(result, ensure_ascii=False), int(is_error), bid, idx)).rowcount > 0

    def results(self, bid: str) -> list[tuple[int, str | None, dict | None, bool]]:
        """Every line in input order: (index, custom_id, result or None if unfinished, is_error)."""
        with self.lock:
            rows = self.db.execute("SELECT idx, custom_id, result, is_error FROM lines WHERE batch_id = ? ORDER BY idx",
                                   (bid,)).fetchall()
        return [(i, c, json.loads(r) if r else None, bool(e)) for i, c, r, e in rows]

    def finalize(self, bid: str, status: str) -> dict:
        """Write the output and error files from the lines (input order; lines never run are
        left out, as OpenAI does for a cancelled or expired batch) and close the batch as
        `status`, in one transaction."""
        now = int(time.time())
        with self.transaction() as db:
            owner, obj = db.execute("SELECT owner, obj FROM batches WHERE id = ?", (bid,)).fetchone()
            obj = json.loads(obj)
            rows = db.execute("SELECT result, is_error FROM lines WHERE batch_id = ? AND state = 'done' ORDER BY idx",
                              (bid,)).fetchall()
            outputs = [r for r, e in rows if not e]
            errors = [r for r, e in rows if e]
            for kind, key, content in (("batch_output", "output_file_id", outputs), ("batch_output", "error_file_id", errors)):
                if not content or obj.get(key):
                    continue
                data = ("\n".join(content) + "\n").encode()
                fid = new_id("file")
                name = f"{bid}_{'output' if key == 'output_file_id' else 'error'}.jsonl"
                db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)", (fid, owner, kind, name, len(data), now, data))
                obj[key] = fid
            obj["status"] = status
            obj[{"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at",
                 "failed": "failed_at"}[status]] = now
            db.execute("UPDATE batches SET obj = ?, status = ? WHERE id = ?", (json.dumps(obj), status, bid))
        return self.batch(None, bid)


def file_object(fid: str, purpose: str, filename: str, size: int, created: int) -> dict:
    return {"id": fid, "object": "file", "bytes": size, "created_at": created, "filename": filename,
            "purpose": purpose, "status": "processed", "status_details": None}


# --- running lines -----------------------------------------------------------------------------
async def execute(state: Any, url: str, body: dict, priority: int = BATCH_PRIORITY) -> tuple[int, dict]:
    """One line, answered as its endpoint answers a request: (HTTP status, body)."""
    kind, prepare, render, prefix = {
        "/v1/chat/completions": (ChatRequest, prepare_chat, chat_body, "chatcmpl"),
        "/v1/completions": (CompletionRequest, prepare_completion, completion_body, "cmpl")}[url]
    try:
        req, server, prep = parse_and_prepare(json.dumps(body).encode(), kind, prepare, state)
        gen = Generation(server.engine, prep.requests, priority, time.perf_counter(), stream=False)
        background = priority >= BATCH_PRIORITY       # yields to live requests: not counted as live
        server.num_background += gen.num_requests if background else 0
        try:
            final = await run_to_end(gen, None)
        finally:
            server.num_background -= gen.num_requests if background else 0
        return 200, render(final, req, prep, server.engine.tokenizer, response_id(prefix), now(), server.model_id)
    except APIError as exc:
        if exc.status == 503:              # loading, restarting or draining: not the line's fault
            raise NotReady(str(exc)) from None
        return exc.status, exc.body()
    except Exception as exc:               # a fault of this line alone: its error line, the batch goes on
        log.exception("batch line to %s failed", url)
        return 500, APIError(500, f"internal error: {exc}", "server_error", None, "internal_error").body()


class NotReady(Exception):
    """The line's model is loading or restarting: the line waits (it is not its error)."""


class BatchRunner:
    """Runs the unfinished batches of a store, oldest first, one at a time, up to one full
    batch of lines at once per model, and only while no live request is in flight there."""

    def __init__(self, state: Any, store: BatchStore, on_line: Callable[[], None] | None = None,
                 server: str | None = None) -> None:
        self.state = state
        self.store = store
        self.server = server            # whose batches serve_forever runs (None: every batch)
        self.wake = asyncio.Event()
        self.on_line = on_line
        self.num_running = 0                    # lines in flight
        self.live_seen: dict[int, float] = {}   # id(ModelServer) -> when live work was last seen there

    def _server(self, body: dict) -> Any:
        """The line's model (a model that is not a served name, or not a string, is the line's
        error, reported by execute against the primary model)."""
        model = body.get("model")
        server = self.state.models.get(model) if isinstance(model, str) else None
        return server if server is not None else self.state.primary

    def _live(self, server: Any) -> bool:
        """Whether live requests are in flight on `server`, or were within LIVE_QUIET_S (a client
        sending one request after another leaves gaps a batch line must not fill)."""
        now = time.monotonic()
        if server.num_live > 0:
            self.live_seen[id(server)] = now
            return True
        return now - self.live_seen.get(id(server), -1e9) < LIVE_QUIET_S

    async def serve_forever(self) -> None:
        while True:
            ids = self.store.unfinished(self.server)
            if not ids:
                self.wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), 1.0)
                continue
            try:
                await self.run(ids[0])
            except asyncio.CancelledError:
                raise
            except Exception:             # a store error: logged, retried after a pause
                log.exception("batch %s", ids[0])
                await asyncio.sleep(1.0)

    async def run(self, bid: str) -> dict:
        """Run a batch's pending lines to the end (or until it is cancelled or expires), then
        write its files."""
        obj = self.store.batch(None, bid)
        if obj["status"] == "cancelling":
            return self.store.finalize(bid, "cancelled")
        if obj["status"] != "finalizing":
            todo = self.store.pending(bid)
            tasks: dict[asyncio.Task, tuple[int, str, dict, Any]] = {}
            next_status = 0.0
            while todo or tasks:
                if time.monotonic() >= next_status:
                    next_status = time.monotonic() + STATUS_POLL_S
                    status = self.store.status(bid)
                    expires = obj.get("expires_at")       # None: an offline run (run-batch) never expires
                    if status == "cancelling" or (expires is not None and time.time() > expires):
                        for t in tasks:
                            t.cancel()
                        await asyncio.gather(*tasks, return_exceptions=True)
                        return self.store.finalize(bid, "cancelled" if status == "cancelling" else "expired")
                todo = self._start(bid, todo, tasks)
                done, _ = await asyncio.wait(tasks, timeout=LIVE_POLL_S, return_when=asyncio.FIRST_COMPLETED) \
                    if tasks else (set(), set())
                if not tasks:
                    await asyncio.sleep(LIVE_POLL_S)
                for t in done:
                    idx, cid, req, server = tasks.pop(t)
                    self.num_running -= 1
                    try:
                        status_code, body = t.result()
                    except (asyncio.CancelledError, NotReady):
                        todo.insert(0, (idx, cid, req))
                        continue
                    self.store.finish_line(bid, idx, result_line(cid, status_code, body), status_code != 200)
                    if self.on_line:
                        self.on_line()
            self.store.update(bid, status="finalizing", finalizing_at=int(time.time()))
        return self.store.finalize(bid, "completed")

    def _start(self, bid: str, todo: list, tasks: dict) -> list:
        """Start lines while their model has room and no live traffic; the rest stay in `todo`
        (scanned only as far as some model can take a line: the scan runs every poll)."""
        room: dict[int, int] = {}
        for server in self.state.servers:
            ok = server.engine.ready.is_set() and not self._live(server)
            room[id(server)] = max(1, server.engine.places - 1) if ok else 0     # a place kept for live work
        for _, _, _, server in tasks.values():
            room[id(server)] = room.get(id(server), 0) - 1
        left = []
        for k, item in enumerate(todo):
            if all(v <= 0 for v in room.values()):
                left.extend(todo[k:])
                break
            idx, cid, req = item
            server = self._server(req["body"])
            if room.get(id(server), 0) <= 0:
                left.append(item)
                continue
            room[id(server)] -= 1
            task = asyncio.ensure_future(execute(self.state, req["url"], req["body"]))
            tasks[task] = (idx, cid, req, server)
            self.num_running += 1
        return left


# --- the HTTP API (a guest of the server) ---------------------------------------------------------
_ERROR_REF = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
_WHY = {400: "invalid request: the error names the field", 401: "authentication required or invalid",
        404: "no such file or batch for this API key", 413: "file larger than max_file_bytes",
        415: "body is not JSON"}
_FILE = {"type": "object", "required": ["id", "object", "bytes", "created_at", "filename", "purpose"],
         "properties": {"id": {"type": "string"}, "object": {"const": "file"}, "bytes": {"type": "integer"},
                        "created_at": {"type": "integer"}, "filename": {"type": "string"},
                        "purpose": {"type": "string"}}}
_BATCH = {"type": "object", "required": ["id", "object", "endpoint", "input_file_id", "completion_window", "status",
                                         "created_at", "request_counts"],
          "properties": {"id": {"type": "string"}, "object": {"const": "batch"}, "status": {"enum": [
              "validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled"]},
              "request_counts": {"type": "object", "required": ["total", "completed", "failed"]}}}


def _list_of(item: dict) -> dict:
    return {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": item}}}


def _doc(ok: dict | None, errors: tuple[int, ...], media: str = "application/json") -> dict:
    """FastAPI `responses=` for a route: its 200 body and its errors in the OpenAI shape."""
    out: dict = {code: {"description": _WHY[code], "content": _ERROR_REF} for code in errors}
    if ok is not None:
        out[200] = {"description": "OK", "content": {media: {"schema": ok}}}
    return out


_UPLOAD = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary"}, "purpose": {"enum": ["batch"]}}}}}}}
_CREATE = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["input_file_id", "endpoint"], "additionalProperties": False, "properties": {
        "input_file_id": {"type": "string"}, "endpoint": {"enum": list(ENDPOINTS)},
        "completion_window": {"enum": [WINDOW]},
        "metadata": {"type": ["object", "null"], "maxProperties": 16,
                     "additionalProperties": {"type": "string", "maxLength": 512}}}}}}}}
_LIST_PARAMS = {"parameters": [
    {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
    {"name": "limit", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1, "maximum": 100}}]}


def install(app: FastAPI, state: Any) -> None:
    cfg = state.cfg
    store = BatchStore(Path(cfg.batch_dir or default_data_dir()) / "batches.sqlite3")
    # Servers on one host share the default store: each runs the batches it accepted (a server
    # restarted on its port resumes its own), and any of them answers for every batch.
    server = f"{socket.gethostname()}:{cfg.port}" + (f":{os.getpid()}" if cfg.port == 0 else "")
    runner = BatchRunner(state, store, server=server)
    state.primary.guests["batches"] = (store, runner)
    state.background.append(runner.serve_forever)

    def owner(request: Request) -> str:
        return state.authenticate(request) or ""

    def not_found(what: str, oid: str) -> APIError:
        return APIError(404, f"no {what} {oid!r}", "invalid_request_error", None, "not_found")

    @app.post("/v1/files", responses=_doc(_FILE, (400, 401, 413)), openapi_extra=_UPLOAD)
    async def upload(request: Request) -> JSONResponse:
        who = owner(request)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > cfg.max_file_bytes + 64 * 1024:
            raise APIError(413, f"file larger than max_file_bytes ({cfg.max_file_bytes} bytes)",
                           "invalid_request_error", "file", "file_too_large")
        try:
            form = await request.form(max_files=1, max_fields=4)
        except Exception as exc:       # starlette raises its own parse errors for a bad multipart body
            raise bad_request(f"expected a multipart form with `file` and `purpose` ({exc})", "file") from None
        purpose, upload_file = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise bad_request(f"purpose must be 'batch' (got {purpose!r})", "purpose", "invalid_value")
        if upload_file is None or isinstance(upload_file, str):
            raise bad_request("missing the `file` part", "file", "missing_field")
        content = await upload_file.read(cfg.max_file_bytes + 1)
        if len(content) > cfg.max_file_bytes:
            raise APIError(413, f"file larger than max_file_bytes ({cfg.max_file_bytes} bytes)",
                           "invalid_request_error", "file", "file_too_large")
        if store.count_files(who) >= cfg.max_files:
            raise bad_request(f"this key keeps {cfg.max_files} files already (max_files); delete some first",
                              "file", "too_many_files")
        return JSONResponse(store.add_file(who, "batch", upload_file.filename or "upload.jsonl", content))

    @app.get("/v1/files", responses=_doc(_list_of(_FILE), (401,)))
    async def list_files(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": store.files(owner(request)), "has_more": False})

    @app.get("/v1/files/{fid}", responses=_doc(_FILE, (401, 404)))
    async def get_file(fid: str, request: Request) -> JSONResponse:
        found = store.file(owner(request), fid)
        if found is None:
            raise not_found("file", fid)
        return JSONResponse(found[0])

    @app.get("/v1/files/{fid}/content", responses=_doc({"type": "string"}, (401, 404), "application/jsonl"))
    async def file_content(fid: str, request: Request) -> Response:
        found = store.file(owner(request), fid, content=True)
        if found is None:
            raise not_found("file", fid)
        return Response(found[1], media_type="application/jsonl")

    @app.delete("/v1/files/{fid}", responses=_doc({"type": "object"}, (401, 404)))
    async def delete_file(fid: str, request: Request) -> JSONResponse:
        if not store.delete_file(owner(request), fid):
            raise not_found("file", fid)
        return JSONResponse({"id": fid, "object": "file", "deleted": True})

    @app.post("/v1/batches", responses=_doc(_BATCH, (400, 401, 404, 413, 415)), openapi_extra=_CREATE)
    async def create_batch(request: Request) -> JSONResponse:
        who = owner(request)
        raw = await read_body(request, cfg.max_body_bytes)
        try:
            body = json.loads(raw or b"null")
        except ValueError as exc:
            raise bad_request(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        extra = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"}
        if extra:
            raise bad_request(f"unknown field {sorted(extra)[0]!r}", sorted(extra)[0], "unknown_field")
        fid, endpoint = body.get("input_file_id"), body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)} (got {endpoint!r})", "endpoint",
                              "invalid_value")
        if body.get("completion_window", WINDOW) != WINDOW:
            raise bad_request(f"completion_window must be {WINDOW!r}", "completion_window", "invalid_value")
        metadata = body.get("metadata")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or any(
                not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512
                for k, v in metadata.items())):
            raise bad_request("metadata: at most 16 string keys (64 characters) to string values (512)",
                              "metadata", "invalid_value")
        found = store.file(who, fid, content=True) if isinstance(fid, str) else None
        if found is None:
            raise APIError(404, f"no file {fid!r}", "invalid_request_error", "input_file_id", "not_found")
        try:
            lines = await asyncio.to_thread(parse_lines, found[1], endpoint, cfg.max_batch_lines)
        except ValueError as exc:
            raise bad_request(f"input_file_id: {exc}", "input_file_id", "invalid_file") from None
        if not lines:
            raise bad_request("input_file_id: the file has no lines", "input_file_id", "invalid_file")
        obj = store.create_batch(who, fid, endpoint, lines, metadata, server=runner.server)
        runner.wake.set()
        return JSONResponse(obj)

    @app.get("/v1/batches", responses=_doc(_list_of(_BATCH), (400, 401)), openapi_extra=_LIST_PARAMS)
    async def list_batches(request: Request) -> JSONResponse:
        after, limit = request.query_params.get("after"), request.query_params.get("limit", "20")
        if not (limit.isascii() and limit.isdigit() and 1 <= int(limit) <= 100):
            raise bad_request(f"limit must be an integer in [1, 100] (got {limit[:20]!r})", "limit", "invalid_value")
        limit = int(limit)
        data = store.batches(owner(request), after, limit + 1)
        return JSONResponse({"object": "list", "data": data[:limit], "first_id": data[0]["id"] if data else None,
                             "last_id": data[:limit][-1]["id"] if data else None, "has_more": len(data) > limit})

    @app.get("/v1/batches/{bid}", responses=_doc(_BATCH, (401, 404)))
    async def get_batch(bid: str, request: Request) -> JSONResponse:
        obj = store.batch(owner(request), bid)
        if obj is None:
            raise not_found("batch", bid)
        return JSONResponse(obj)

    @app.post("/v1/batches/{bid}/cancel", responses=_doc(_BATCH, (401, 404)))
    async def cancel_batch(bid: str, request: Request) -> JSONResponse:
        who = owner(request)
        obj = store.batch(who, bid)
        if obj is None:
            raise not_found("batch", bid)
        if obj["status"] in ("in_progress", "validating"):
            store.update(bid, status="cancelling", cancelling_at=int(time.time()))
            runner.wake.set()
        return JSONResponse(store.batch(who, bid))


# --- `leapfrog run-batch` ----------------------------------------------------------------------------
def progress_db(data_dir: Path, input_path: Path, output_path: Path) -> Path:
    key = hashlib.sha256(f"{input_path.resolve()}\0{output_path.resolve()}".encode()).hexdigest()[:16]
    return data_dir / f"run-batch-{key}.sqlite3"
