"""A cap on request bodies, before anything buffers them: a 300 MB body once took the API to 1.25 GB.

An ASGI middleware (`BodyLimit`): a request that declares a larger `Content-Length` is answered 413 at once, its
body never read; a body without one (chunked) is counted as it streams in and refused with 413 as soon as it
passes the cap, so at most the cap is ever read. The cap is `GPUQ_API_MAX_BODY_BYTES` (default 8 MiB: a
thousand-job submission of ordinary specs is well under it; one spec is capped at 64 KiB by governance).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from shared.settings import settings

ENV_VAR = "GPUQ_API_MAX_BODY_BYTES"
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def max_body_bytes_from_env() -> int:
    return settings().api_max_body_bytes


def too_large(max_bytes: int, size: int | None = None) -> str:
    got = f"{size} bytes" if size is not None else f"more than {max_bytes} bytes"
    return (f"request body too large: {got}, at most {max_bytes} ({ENV_VAR}); submit fewer jobs per request or "
            "smaller specs")


class BodyLimit:
    """Refuse request bodies over `max_bytes` with 413, by their declared length and by what actually arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared == -1:
            await _answer(send, 400, "Content-Length is not a number of bytes")
            return
        if declared is not None and declared > self.max_bytes:
            await _answer(send, 413, too_large(self.max_bytes, declared))
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the handler's read: the app's exception handling answers 413.
                    raise HTTPException(413, too_large(self.max_bytes))
            return message

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int | None:
    """The declared length; None when absent, -1 when not a plain number (refused: it cannot be checked)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() else -1
    return None


async def _answer(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
