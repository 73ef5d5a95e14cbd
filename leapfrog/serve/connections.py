"""Connections that never finish their headers are closed.

uvicorn bounds the idle time between requests on a kept-alive connection (timeout_keep_alive),
but not the time a request's headers take to arrive: a client that opens many connections and
sends a header line every few seconds holds them open for ever (slowloris). The protocol below
is uvicorn's own (httptools when installed, else h11) with one timer more: armed when a
connection opens, or when the first bytes of a further request arrive on it, it closes the
connection if no new request has started (its headers parsed) `seconds` later.
"""
from __future__ import annotations

import asyncio
from typing import Any


def _base_protocol() -> type:
    # deferred: uvicorn's protocols load only when the server is set up; httptools is optional
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    except ImportError:          # httptools not installed: uvicorn's pure-Python parser
        from uvicorn.protocols.http.h11_impl import H11Protocol
        return H11Protocol


def header_timeout_protocol(seconds: float) -> type:
    """uvicorn's HTTP protocol class, closing connections whose headers take over `seconds`."""
    base = _base_protocol()

    class HeaderTimeoutProtocol(base):       # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None
        _armed_for: Any = None           # the cycle before the request the timer waits for

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            # the first bytes of a further request on a kept-alive connection start its clock
            # (once per request: bytes trickling in do not restart it)
            if self.cycle is not None and self.cycle.response_complete and self._armed_for is not self.cycle:
                self._arm()
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._armed_for = self.cycle
            self._header_timer = self.loop.call_later(seconds, self._headers_late, self.cycle)

        def _headers_late(self, cycle: Any) -> None:
            self._header_timer = None
            if self.cycle is cycle and not self.transport.is_closing():   # no request has started since
                self.transport.close()

    return HeaderTimeoutProtocol


def http_protocol(header_timeout: float) -> Any:
    """uvicorn.Config's `http`: "auto" without a header timeout."""
    return header_timeout_protocol(header_timeout) if header_timeout > 0 else "auto"
