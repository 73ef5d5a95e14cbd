"""`leapfrog serve`: the HTTP server (FastAPI + uvicorn) as it runs, the HTTP core (app.py) with
its guests, the chat page (chat_page.py) and the couplet terminal (couplet.py).

The engine runs in one background thread per served model (engine_thread.AsyncEngine); handlers
validate, queue, and stream. Endpoints: POST /generate, /v1/completions, /v1/chat/completions,
/tokenize, /detokenize; GET /v1/models, /health, /healthz, /ready, /metrics; the chat page GET /;
the couplet page GET /couplet and POST /couplet. Configuration: config.py.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
import threading
import time
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI

from leapfrog.config import resolve_model
from leapfrog.methods import draft_model_check
from leapfrog.models.loader import read_config
from leapfrog.layers.parallel import launched_by_torchrun
from leapfrog.serve import app as http_core
from leapfrog.serve import batches, chat_page, couplet
from leapfrog.serve.app import ServerState, model_engine_factory
from leapfrog.serve.config import ConfigError, ServerConfig, add_arguments, build_config, flags_from_args
from leapfrog.serve.connections import http_protocol

log = logging.getLogger(__name__)
GUESTS = (couplet.install, chat_page.install, batches.install)


def create_app(cfg: ServerConfig, engine_factory: Callable[[], Any] | None = None) -> FastAPI:
    """The served app: the HTTP core and its guests; `engine_factory` (tests) replaces the first
    served model's engine."""
    return http_core.create_app(cfg, engine_factory, GUESTS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="leapfrog serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Precedence: flags > environment (LEAPFROG_<KEY>; also CACHE_SIZE, MAX_TOKENS, BATCH_SIZE, "
               "TEMPERATURE) > --config file > defaults. See examples/*.yaml.")
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = build_config(flags_from_args(args))
    except ConfigError as exc:
        print(f"leapfrog serve: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper() if cfg.log_level != "trace" else "DEBUG",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        for view in cfg.views():      # fail before binding the port, not in the background
            folder = resolve_model(view.model)
            if folder.is_dir():
                read_config(folder)   # a folder that is no checkpoint is named now
            draft_model_check(view.engine_kwargs()["method"], view.draft_model)
    except (FileNotFoundError, ValueError) as exc:     # no such model, a broken file named, a drafter unread
        print(f"leapfrog serve: {exc}", file=sys.stderr)
        return 2
    follower = torchrun_role(cfg)
    if follower is not None:
        return follower
    taken = port_taken(cfg.host, cfg.port)
    if taken:                         # say so now, not after the models have loaded
        print(f"leapfrog serve: cannot listen on {cfg.host}:{cfg.port}: {taken}", file=sys.stderr)
        return 2
    app = create_app(cfg)
    server = DrainingServer(uvicorn.Config(
        app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, ssl_certfile=cfg.ssl_certfile,
        ssl_keyfile=cfg.ssl_keyfile, timeout_graceful_shutdown=cfg.shutdown_timeout or None,
        http=http_protocol(cfg.header_timeout), ws="none"))     # no WebSocket routes: nothing to import
    state: ServerState = app.state.leapfrog
    # A model that cannot load is fatal: exiting lets the supervisor (systemd, Kubernetes)
    # restart or report it, where a live process answering 503 forever would hide it.
    for m in state.servers:
        m.engine.on_fatal = lambda: setattr(server, "should_exit", True)
    log.info("serving %s on %s://%s:%d", ", ".join(m.model_id for m in state.servers),
             "https" if cfg.ssl_certfile else "http", cfg.host, cfg.port)
    for line in startup_warnings(cfg, state.auth.enabled):
        log.warning("%s", line)
    server.run()
    return 1 if any(m.engine.load_error is not None for m in state.servers) else 0


def port_taken(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound (another process holds it, no such address), or None. It
    binds the way uvicorn will (SO_REUSEADDR) and lets go at once; port 0 is always free."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"no such address ({exc.strerror})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def torchrun_role(cfg: ServerConfig) -> int | None:
    """Under torchrun (one replica over several nodes), None on rank 0, which serves HTTP; on
    any other rank, the exit code after following rank 0's engine until it stops. Errors: a
    group of another size than tensor_parallel_size x pipeline_parallel_size, several models."""
    if not launched_by_torchrun():
        return None
    # deferred: engine.distributed loads only under torchrun
    from leapfrog.engine.distributed import num_ranks
    world = int(os.environ["WORLD_SIZE"])
    if num_ranks(cfg.engine) != world:
        print(f"leapfrog serve: torchrun started {world} processes, but tensor_parallel_size x "
              f"pipeline_parallel_size is {num_ranks(cfg.engine)}: set them so that they multiply to {world}",
              file=sys.stderr)
        return 2
    if len(cfg.views()) > 1:
        print("leapfrog serve: under torchrun the ranks run one model; name it with --model", file=sys.stderr)
        return 2
    if int(os.environ["RANK"]) == 0:
        return None
    try:
        model_engine_factory(cfg)()          # follows rank 0 inside this call, then exits
    except SystemExit as done:
        return int(done.code or 0)
    return 0


def startup_warnings(cfg: ServerConfig, auth_enabled: bool) -> list[str]:
    """What an operator must hear about at start: an open server on a network address, fault
    injection left on."""
    out = []
    try:
        loopback = ipaddress.ip_address(cfg.host).is_loopback
    except ValueError:
        loopback = cfg.host == "localhost"
    if not loopback and not auth_enabled:
        out.append(f"no API key is configured and the server listens on {cfg.host}, which is not a loopback "
                   "address: anyone who can reach this port can generate. Set --api-key (or --api-key-file / "
                   "--jwt-secret), or bind --host 127.0.0.1")
    if cfg.fault_injection:
        out.append("fault injection is on: POST /admin/fault crashes an engine on demand. Never in production")
    return out


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT the server drains: readiness answers 503 at once (so a load balancer
    stops sending) and new generations get 503, while the requests in flight finish, up to
    shutdown_timeout; then uvicorn shuts down and the process exits 0. A second signal stops
    at once."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        state: ServerState = self.config.app.state.leapfrog
        if state.draining:          # second signal: stop now
            self.should_exit = self.force_exit = True
            return
        state.draining = True
        log.info("draining: %d requests in flight", sum(m.engine.num_in_flight for m in state.servers))
        threading.Thread(target=self._exit_when_drained, args=(state,), daemon=True).start()

    def _exit_when_drained(self, state: ServerState) -> None:
        deadline = time.monotonic() + (state.cfg.shutdown_timeout or float("inf"))   # 0: no limit
        while any(m.engine.num_in_flight > 0 for m in state.servers) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True
