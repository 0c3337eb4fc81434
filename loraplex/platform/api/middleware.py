"""ASGI middleware of the app: the request body size limit, per path.

A body over the limit is refused with 413 after at most the limit's bytes: a declared
``Content-Length`` over it at once, a chunked (or lying) body as soon as it passes it.
Uploads (``/v1/adapters``) have a limit of their own (``max_upload_bytes``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.api.errors import APIError


def body_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"Request body is larger than the server's limit of {limit} bytes.",
        code="request_too_large",
    )


class BodySizeLimit:
    """ASGI middleware: 413 for a declared ``Content-Length`` over the limit, and a
    receive channel that stops a body (chunked or lying about its length) as soon as
    it passes the limit, so an oversized body is never buffered whole."""

    def __init__(self, app: ASGIApp, max_bytes: int, shown_bytes: int | None = None) -> None:
        """``shown_bytes``: the limit the message quotes, when ``max_bytes`` adds room for framing
        (an upload's multipart headers) to a limit the client knows by another number."""
        self.app = app
        self.max_bytes = max_bytes
        self.shown_bytes = shown_bytes or max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    await send_error(send, body_too_large(self.shown_bytes))
                    return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the route's body read, so the app's handler answers 413.
                    raise body_too_large(self.shown_bytes)
            return message

        await self.app(scope, limited_receive, send)


async def send_error(send: Send, err: APIError) -> None:
    """Answer ``err`` from middleware (before any route), closing the connection."""
    payload = json.dumps(err.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class BodyLimits:
    """ASGI middleware: ``BodySizeLimit``, with a limit of their own for some paths (uploads)."""

    def __init__(
        self,
        app: ASGIApp,
        default_bytes: int,
        by_path: Mapping[str, int],
        shown_by_path: Mapping[str, int] | None = None,
    ) -> None:
        shown = shown_by_path or {}
        self.default = BodySizeLimit(app, default_bytes)
        self.by_path = {path: BodySizeLimit(app, limit, shown.get(path)) for path, limit in by_path.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limiter = self.by_path.get(scope.get("path", ""), self.default) if scope["type"] == "http" else None
        await (limiter or self.default)(scope, receive, send)


class NoSniff:
    """``X-Content-Type-Options: nosniff`` on every response (JSON errors, streams, 413s, probes):
    a browser must never guess an answer's type from what a tenant made the model write."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"x-content-type-options" for name, _ in headers):
                    headers.append((b"x-content-type-options", b"nosniff"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_header)
