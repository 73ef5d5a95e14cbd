"""The chat page, a guest of the HTTP server: `GET /` serves static/chat.html, a one-file page that
talks to POST /v1/chat/completions (streamed) and GET /v1/models. The conversation stays in the
browser; the server keeps nothing of it. `install` adds the route and its OpenAPI entry."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from leapfrog.serve.app import ServerState
from leapfrog.serve.schema import Extension

CHAT_PAGE = Path(__file__).parent / "static" / "chat.html"
# Inline script and style only; fetches go to this server alone.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
                "img-src 'self' data:; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def install(app: FastAPI, state: ServerState) -> None:
    """Adds `GET /` (the chat page) and its entry in the OpenAPI document."""
    state.schema_extensions.append(SCHEMA)

    @app.get("/", response_class=HTMLResponse)
    async def chat_page() -> HTMLResponse:
        """The chat page: streamed replies, the model and drafting on or off, tok/s and tokens per forward."""
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"), headers=PAGE_HEADERS)


SCHEMA = Extension(html_pages={"/": "the chat page (HTML)"})
