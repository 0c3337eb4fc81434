"""``RequestRecord``: what one HTTP request did, filled in by the layers it passes through.

The ``RequestObserver`` middleware opens a record when a request arrives and puts it in the ASGI
scope; the gate names the tenant, ``respond`` the model, adapter and engine streams, the error
handlers (and a stream's error event) the error that ended it. When the response is over the
observer closes it and hands it to the metrics and the access log, so every count and log
field comes from one object, built once per request.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from loraplex.platform.api.errors import APIError
    from loraplex.platform.engine.outputs import RequestOutput


class MeteredRun(Protocol):
    """What the record reads of an engine request it ran (``openai.submission.MeteredStream``):
    declared here so the record depends on no request pipeline."""

    @property
    def last(self) -> RequestOutput | None:
        """The request as read so far: its last output, or its deltas merged (what it used)."""

    @property
    def first_token_s(self) -> float | None:
        """Monotonic time its first token was read (None before)."""

    @property
    def token_gaps_s(self) -> list[tuple[float, int]]:
        """``(seconds per token, tokens)`` per output that brought tokens after the first."""


RECORD_KEY = "loraplex.request_record"
"""Key of the record in the ASGI scope's ``state`` (Starlette's ``request.state``)."""

INFERENCE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
"""Requests counted in the request metrics (every request is access-logged)."""


@dataclass
class RequestRecord:
    """One request from arrival to the end of its response (see the module docstring)."""

    method: str
    path: str
    start_s: float = field(default_factory=time.monotonic)
    end_s: float | None = None
    status: int = 0
    """HTTP status sent (0 until the response starts)."""
    tenant: str | None = None
    """The tenant's name once the caller is authenticated (``local`` in open and single-tenant mode)."""
    model: str | None = None
    adapter: str | None = None
    """The adapter's model name, when the request ran on one."""
    stream: bool = False
    streams: Sequence[MeteredRun] = ()
    """The engine requests submitted for it (one per prompt)."""
    error: APIError | None = None
    """The error that ended it: an error response, or a stream's error event after a 200."""
    prompts: Sequence[Any] | None = None
    """Its prompts, kept only when the access log is told to log them."""

    def failed(self, err: APIError) -> None:
        """The request ended with ``err`` (the first error wins: later ones are its echoes)."""
        if self.error is None:
            self.error = err

    @property
    def is_inference(self) -> bool:
        return self.path in INFERENCE_PATHS

    @property
    def effective_status(self) -> int:
        """The status the client was told: the error's for a stream that failed after its 200."""
        if self.error is not None and self.status in (0, 200):
            return self.error.status
        return self.status or 500

    @property
    def latency_s(self) -> float:
        return (self.end_s if self.end_s is not None else time.monotonic()) - self.start_s

    @property
    def ttft_s(self) -> float | None:
        """From arrival to the first token of any of its prompts (None if none came)."""
        firsts = [s.first_token_s for s in self.streams if s.first_token_s is not None]
        return min(firsts) - self.start_s if firsts else None


def record_of(scope: MutableMapping[str, Any]) -> RequestRecord | None:
    """The record the observer opened for this request (None outside the observer, e.g. in tests)."""
    state = scope.get("state")
    record = state.get(RECORD_KEY) if isinstance(state, dict) else None
    return record if isinstance(record, RequestRecord) else None


def note_error(scope: MutableMapping[str, Any], err: APIError) -> None:
    """Remember the error that ends this request (the first one wins: later ones are its echoes)."""
    record = record_of(scope)
    if record is not None:
        record.failed(err)
