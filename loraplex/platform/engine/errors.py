"""The engine's own errors: what a caller did wrong, told apart from the engine's bugs.

The HTTP layer maps these (and only these) to client errors; anything else that
escapes is a bug and becomes a 500 with a logged trace. They subclass ``ValueError``
/ ``LookupError`` so offline code that caught those keeps working.

| error | HTTP | raised when |
|---|---|---|
| ``InvalidParameterError`` | 400 | a request parameter is out of range, of the wrong type, or over a limit |
| ``StructuredOutputError`` | 400 | a JSON schema / regex / grammar is invalid or over the compile bounds |
| ``RequestTooLargeError`` | 400 | a request can never be admitted (prompt, ``n`` or tokens too large) |
| ``AdapterNotFoundError`` (adapters) | 404 | a request names an adapter the engine does not serve |
| ``AdapterUnavailableError`` | 400 | the adapter exists but cannot be served (LoRA off, invalid files) |
| ``EngineDeadError`` | 503 | the engine loop stopped and cannot serve anything |
| ``EngineOverloadedError`` | 503, ``Retry-After`` | ``max_queued_requests`` wait already (nothing queued) |

A request the engine accepted and then ended itself carries a ``RequestError`` in
``RequestOutput.error``: its ``kind`` (an ``ErrorKind``) decides the HTTP status, never its text.

| ``ErrorKind`` | HTTP | the engine ended the request because |
|---|---|---|
| ``DEADLINE`` | 408 | it waited and ran longer than its ``request_timeout_s`` |
| ``ABORTED`` | 503 | the server ended it (shutting down) |
| ``ADAPTER_UNAVAILABLE`` | 503 | its adapter was removed, or failed to load, while it waited |
| ``INVALID`` | 400 | it can never run (never fits the KV pool; its stop tokens ban every token) |
| ``ENGINE_FAILURE`` | 500 | a step or its planning failed (a bug, a device fault, non-finite logits) |
| ``OVERLOAD`` | 503 | (reserved: overload is refused at submission, ``EngineOverloadedError``) |
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, get_args


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidParameterError(EngineError, ValueError):
    """A request parameter is invalid; ``param`` names it (OpenAI's ``param`` field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.message = message

    def __str__(self) -> str:
        return self.message


class StructuredOutputError(InvalidParameterError):
    """A request's output constraint (JSON schema, regex, choice, grammar) is invalid or over the
    bounds of a tenant's schema (``engine.structured.bounds``); ``param`` names the field."""


class RequestTooLargeError(InvalidParameterError):
    """The request could never be admitted under the engine's limits (never queued)."""


class AdapterUnavailableError(InvalidParameterError):
    """The adapter is known but cannot serve this request (LoRA disabled, bad weights, removed)."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine loop has stopped; no request can be served until the process restarts."""


class EngineOverloadedError(EngineError):
    """``max_queued_requests`` sequences wait already: refused at once, nothing queued (503)."""

    def __init__(self, num_waiting: int, limit: int, retry_after_s: int = 1) -> None:
        super().__init__(num_waiting, limit)
        self.num_waiting = num_waiting
        self.limit = limit
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return (
            f"The server is overloaded: {self.num_waiting} requests are queued (the limit, "
            f"max_queued_requests, is {self.limit}); retry after {self.retry_after_s} s."
        )


RejectionReason = Literal[
    "rate_limit",
    "token_limit",
    "concurrency",
    "overload",
    "deadline",
    "invalid",
    "unauthorized",
    "quota_unavailable",
    "shutting_down",
]
"""Why a request was refused or cut short: the one vocabulary of the engine's ``rejections``
counters and the server's ``loraplex_rejected_requests_total`` label."""

REJECTION_REASONS: tuple[RejectionReason, ...] = get_args(RejectionReason)


class ErrorKind(enum.Enum):
    """Why the engine ended a request it had accepted (see the table in the module docstring)."""

    DEADLINE = "deadline"
    ABORTED = "aborted"
    ADAPTER_UNAVAILABLE = "adapter_unavailable"
    INVALID = "invalid"
    ENGINE_FAILURE = "engine_failure"
    OVERLOAD = "overload"


@dataclass(frozen=True)
class RequestError:
    """A typed reason and a message for the client: ``RequestOutput.error`` of a failed request."""

    kind: ErrorKind
    message: str

    def __str__(self) -> str:
        return self.message
