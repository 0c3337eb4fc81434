"""Every error the server returns, in OpenAI's body ``{"error": {message, type, param, code}}``.

One exception class, ``APIError`` (status, message, code, param, headers), and one place that
maps everything else to it (``to_api_error``). This module is a leaf of the API layer: the handlers
that answer with these bodies (and note the error on the request's record) are
``observability.error_handlers``; the quota refusals are ``tenancy.quotas.refusal``.
Invalid input is always 400 (FastAPI's own 422 included), never 422.

| raised | status | ``code`` |
|---|---|---|
| ``APIError`` | its own, with its headers | its own |
| ``InvalidParameterError`` (engine) | 400 | invalid_value |
| ``AdapterNotFoundError`` (adapters) | 404 | model_not_found |
| ``EngineDeadError`` | 503 | engine_dead |
| ``EngineOverloadedError`` (past ``max_queued_requests``) | 503, ``Retry-After`` | overloaded |
| ``request_error``: a ``RequestError`` the engine ended a request with | by its kind (below) | by its kind |
| ``DatabaseUnavailable``: database unreachable or too slow | 503, ``Retry-After`` | database_unavailable |
| ``unauthorized``: no, wrong, revoked, expired key | 401, ``WWW-Authenticate: Bearer`` | invalid_api_key |
| ``quota_refusal`` (tenancy): rpm, tpm, concurrency | 429, ``Retry-After`` | rate_limit_exceeded |
| ``quota_refusal`` (tenancy): request_over_tpm (never fits) | 429 | rate_limit_exceeded |
| ``quota_refusal`` (tenancy): unavailable (Redis down) | 503, ``Retry-After`` | quota_unavailable |
| ``NotFound`` (services): a tenant, key or adapter by name | 404 | not_found |
| ``Conflict`` (services) | 409 | conflict |
| ``EngineBusy`` (services) | 409, ``Retry-After`` | engine_busy |
| ``QuotaExceeded`` (services) | max_adapters 403, max_adapter_bytes 413 | quota_exceeded |
| ``InvalidInput`` (services) | 400 | invalid_value |
| ``AdapterValidationError`` | 400 | the validation reason (unsafe_archive, pickle_format, ...) |
| FastAPI's own: unknown route, wrong method, bad parameter | 404, 405, 400 | not_found, ... |
| anything else | 500 (logged once by the server) | internal_error |

``RequestTooLargeError`` and ``AdapterUnavailableError`` are ``InvalidParameterError``s.

A request the engine accepted and then ended itself (``RequestOutput.error``) is answered by the
error's ``ErrorKind``, never its text: deadline 408 ``request_timeout``, aborted 503
``request_aborted``, adapter_unavailable 503 ``adapter_unavailable``, overload 503 ``overloaded``,
invalid 400 ``invalid_value``, engine_failure 500 ``internal_error``. In a stream, the same body is
the error event.

A refusal also has a ``reason`` (``rejection_reason``): the label under which
``loraplex_rejected_requests_total`` counts it (rate_limit, token_limit, concurrency,
quota_unavailable, overload, deadline, shutting_down, unauthorized, invalid). An ``APIError`` may
name it (``reason=``); otherwise it follows from the status and ``code``.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from loraplex.adapters import AdapterNotFoundError, AdapterValidationError
from loraplex.platform.api.services.errors import (
    Conflict,
    EngineBusy,
    InvalidInput,
    NotFound,
    QuotaExceeded,
    ServiceError,
)
from loraplex.platform.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    ErrorKind,
    InvalidParameterError,
    RejectionReason,
    RequestError,
)
from loraplex.storage.db import DatabaseUnavailable

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


def error_body(
    message: str, err_type: str = INVALID_REQUEST, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """OpenAI's error envelope (``code`` is a short string such as ``model_not_found``, or None;
    vLLM's own routes answer the status there, an int)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class APIError(Exception):
    """An error answered to the client: status, OpenAI's body, and response headers."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | int | None = None,
        err_type: str = INVALID_REQUEST,
        headers: dict[str, str] | None = None,
        reason: RejectionReason | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type
        self.headers = dict(headers or {})
        self.reason = reason
        """Why the request was refused, for metrics (see ``rejection_reason``); None: derived."""

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


# -- the errors the HTTP layer decides on itself --------------------------------------
def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 naming the offending field."""
    return APIError(400, message, param=param, code=code)


def bad_field(param: str, message: str) -> APIError:
    """A 400 for an invalid value of ``param``."""
    return APIError(400, message, param=param, code="invalid_value")


def unsupported(param: str, what: str = "") -> APIError:
    """A 400 for an OpenAI field this server does not implement (refused, never ignored)."""
    detail = f" {what}" if what else ""
    return APIError(
        400, f"'{param}' is not supported by this server{detail}.", param=param, code="unsupported_parameter"
    )


def unauthorized(message: str, code: str = "invalid_api_key") -> APIError:
    """401 for a missing, malformed, wrong, revoked or expired credential (one message per cause
    the caller can fix: never which of wrong / revoked / expired it was)."""
    return APIError(401, message, code=code, headers={"WWW-Authenticate": "Bearer"})


def forbidden(message: str, code: str = "forbidden") -> APIError:
    return APIError(403, message, code=code)


_REASONS_BY_CODE: dict[str, RejectionReason] = {
    "rate_limit_exceeded": "rate_limit",
    "quota_unavailable": "quota_unavailable",
    "shutting_down": "shutting_down",
    "server_overloaded": "overload",
    "overloaded": "overload",
    "deadline_exceeded": "deadline",
    "request_timeout": "deadline",
    "invalid_api_key": "unauthorized",
}
"""``code`` -> reason, for errors that do not name their reason."""


def rejection_reason(err: APIError) -> RejectionReason | None:
    """Why ``err`` refused (or cut short) a request, as counted in ``loraplex_rejected_requests_total``;
    None for an error that is not a refusal (a 500, the engine gone, a conflict)."""
    if err.reason is not None:
        return err.reason
    by_code = _REASONS_BY_CODE.get(err.code) if isinstance(err.code, str) else None
    if by_code is not None:
        return by_code
    if err.status in (401, 403):
        return "unauthorized"
    if err.status in (400, 404, 405, 413, 422):
        return "invalid"
    if err.status == 429:
        return "rate_limit"
    if err.status == 504:
        return "deadline"
    return None


def database_unavailable(exc: DatabaseUnavailable) -> APIError:
    """503 while the metadata database cannot be reached: the caller should retry, nothing is wrong
    with its request (and a key not seen recently is not refused: the gateway cannot know)."""
    return APIError(
        503,
        exc.reason,
        code="database_unavailable",
        err_type=SERVER_ERROR,
        headers={"Retry-After": str(exc.retry_after_s)},
    )


_REQUEST_ERRORS: dict[ErrorKind, tuple[int, str, str]] = {
    ErrorKind.DEADLINE: (408, "request_timeout", SERVER_ERROR),
    ErrorKind.ABORTED: (503, "request_aborted", SERVER_ERROR),
    ErrorKind.ADAPTER_UNAVAILABLE: (503, "adapter_unavailable", SERVER_ERROR),
    ErrorKind.OVERLOAD: (503, "overloaded", SERVER_ERROR),
    ErrorKind.INVALID: (400, "invalid_value", INVALID_REQUEST),
    ErrorKind.ENGINE_FAILURE: (500, "internal_error", SERVER_ERROR),
}
"""``ErrorKind`` -> (status, code, type): the only place a failed request's status is chosen."""


def request_error(error: RequestError) -> APIError:
    """The answer to a request the engine ended with ``error``: the status from its kind."""
    status, code, err_type = _REQUEST_ERRORS[error.kind]
    headers = {"Retry-After": "1"} if status == 503 else {}
    prefix = "The request failed in the engine: " if status == 500 else ""
    return APIError(status, prefix + error.message, code=code, err_type=err_type, headers=headers)


def overloaded(exc: EngineOverloadedError) -> APIError:
    """503 with ``Retry-After`` for a request refused because the queue is full."""
    return APIError(
        503,
        str(exc),
        code="overloaded",
        err_type=SERVER_ERROR,
        headers={"Retry-After": str(exc.retry_after_s)},
    )


def rejected_adapter(exc: AdapterValidationError, hide: tuple[str, ...] = ()) -> APIError:
    """400 naming the rule an uploaded adapter broke; ``hide``: server paths to cut from the message."""
    message = exc.detail
    for path in hide:
        message = message.replace(path + "/", "").replace(path, "upload")
    return APIError(400, f"The adapter was rejected ({exc.reason}): {message}", param="file", code=exc.reason)


# -- everything else, mapped ----------------------------------------------------------
def _service_error(exc: ServiceError) -> APIError:
    if isinstance(exc, NotFound):
        return APIError(404, f"The {exc.kind} '{exc.name}' does not exist.", code="not_found")
    if isinstance(exc, EngineBusy):
        return APIError(409, str(exc), code="engine_busy", headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, Conflict):
        return APIError(409, str(exc), code="conflict")
    if isinstance(exc, QuotaExceeded):
        status = 413 if exc.quota == "max_adapter_bytes" else 403
        return APIError(status, f"Tenant quota exceeded: {exc}.", param=exc.quota, code="quota_exceeded")
    if isinstance(exc, InvalidInput):
        return bad_field(exc.field, f"Invalid value for '{exc.field}': {exc.detail}.")
    return APIError(500, "internal server error", code="internal_error", err_type=SERVER_ERROR)


def to_api_error(exc: BaseException) -> APIError:
    """The client-facing form of ``exc``; unknown exceptions become a 500 without details."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidParameterError):
        return APIError(400, exc.message, param=exc.param, code="invalid_value")
    if isinstance(exc, AdapterNotFoundError):
        # An engine-internal id (no name) is never shown: it is not the client's word.
        message = str(exc) if exc.name is not None else "The model does not exist."
        return APIError(404, message, param="model", code="model_not_found")
    if isinstance(exc, EngineOverloadedError):
        return overloaded(exc)
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc) or "the engine has stopped", code="engine_dead", err_type=SERVER_ERROR)
    if isinstance(exc, ServiceError):
        return _service_error(exc)
    if isinstance(exc, DatabaseUnavailable):
        return database_unavailable(exc)
    if isinstance(exc, AdapterValidationError):
        return rejected_adapter(exc)
    return APIError(500, "internal server error", code="internal_error", err_type=SERVER_ERROR)


def _validation_message(err: dict[str, Any]) -> tuple[str, str | None]:
    """(message, param) for one pydantic/FastAPI error, reading like OpenAI's."""
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    msg = str(err.get("msg", "invalid value"))
    if err.get("type") == "missing":
        return f"Missing required parameter: '{param}'.", param
    if param is None:
        return f"Invalid request: {msg}.", None
    return f"Invalid value for '{param}': {msg}.", param


def validation_error(errors: list[Any]) -> APIError:
    """The first error of a pydantic ``ValidationError`` (or FastAPI's) as a 400."""
    first = errors[0] if errors else {}
    message, param = _validation_message(dict(first))
    return bad_request(message, param)


MAPPED_ERRORS: tuple[type[Exception], ...] = (
    APIError,
    AdapterNotFoundError,
    InvalidParameterError,
    EngineDeadError,
    EngineOverloadedError,
    ServiceError,
    AdapterValidationError,
    DatabaseUnavailable,
)
"""The exception classes ``to_api_error`` maps (the error handlers route each to it)."""
