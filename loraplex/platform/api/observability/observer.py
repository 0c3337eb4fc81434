"""``RequestObserver``: the ASGI middleware around every request but the probes.

It opens the request's ``RequestRecord`` (routes and error handlers fill it in), notes the
status sent, counts the request in flight for a graceful shutdown (and answers 503 to new
requests while the server drains), and when the response is over closes the record and hands
it to ``on_close`` (the metrics and the access log). ``on_close`` failing never fails a request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.api.lifecycle import Lifecycle, shutting_down
from loraplex.platform.api.observability.record import RECORD_KEY, RequestRecord

logger = logging.getLogger(__name__)

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})


class RequestObserver:
    """ASGI middleware (see the module docstring)."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle, on_close: Callable[[RequestRecord], None]) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        record = RequestRecord(method=scope.get("method", ""), path=scope.get("path", ""))
        state = scope.setdefault("state", {})
        state[RECORD_KEY] = record

        async def observed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = int(message["status"])
            await send(message)

        lifecycle = self.lifecycle
        lifecycle.num_in_flight += 1
        try:
            if lifecycle.draining:
                record.error = shutting_down()
                await record.error.response()(scope, receive, observed_send)
            else:
                await self.app(scope, receive, observed_send)
        except BaseException:
            if not record.status:  # the server's error middleware answers 500 outside this one
                record.status = 500
            raise
        finally:
            lifecycle.num_in_flight -= 1
            record.end_s = time.monotonic()
            try:
                self.on_close(record)
            except Exception:
                logger.exception("could not account for request %s %s", record.method, record.path)
