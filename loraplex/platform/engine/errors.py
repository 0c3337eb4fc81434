"""The engine's own errors: what a caller did wrong, told apart from the engine's bugs.

The HTTP layer maps these (and only these) to client errors; anything else that
escapes is a bug and becomes a 500 with a logged trace. They subclass ``ValueError``
/ ``LookupError`` so offline code that caught those keeps working.

| error | HTTP | raised when |
|---|---|---|
| ``InvalidParameterError`` | 400 | a request parameter is out of range, of the wrong type, or over a limit |
| ``RequestTooLargeError`` | 400 | a request can never be admitted (prompt, ``n`` or tokens too large) |
| ``UnknownAdapterError`` | 404 | a request names an adapter the engine does not serve |
| ``AdapterUnavailableError`` | 400 | the adapter exists but cannot be served (LoRA off, invalid files) |
| ``EngineDeadError`` | 503 | the engine loop stopped and cannot serve anything |
"""

from __future__ import annotations


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


class RequestTooLargeError(InvalidParameterError):
    """The request could never be admitted under the engine's limits (never queued)."""


class UnknownAdapterError(EngineError, LookupError):
    """The request names an adapter that is not registered (or not visible to the caller)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"The model '{self.name}' does not exist."


class AdapterUnavailableError(InvalidParameterError):
    """The adapter is known but cannot serve this request (LoRA disabled, bad weights, removed)."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine loop has stopped; no request can be served until the process restarts."""
