"""The gateway's errors in OpenAI's body: auth, quotas, the services' typed errors, rejected uploads.

| raised | status | ``code`` |
|---|---|---|
| ``GatewayError`` | its own, with its headers | its own |
| ``unauthorized`` (no, wrong, revoked, expired key) | 401, ``WWW-Authenticate: Bearer`` | invalid_api_key |
| ``quota_refusal``: rpm, tpm, concurrency | 429, ``Retry-After`` | rate_limit_exceeded |
| ``quota_refusal``: request_over_tpm (never fits) | 429 | rate_limit_exceeded |
| ``quota_refusal``: unavailable (Redis down, fail_closed) | 503, ``Retry-After`` | quota_unavailable |
| ``NotFound`` | 404 | not_found (model_not_found for a model) |
| ``Conflict`` | 409 | conflict |
| ``QuotaExceeded`` | max_adapters 403, max_adapter_bytes 413 | quota_exceeded |
| ``InvalidInput`` | 400 (like every other invalid field) | invalid_value |
| ``AdapterValidationError`` | 400 | the validation reason (unsafe_archive, pickle_format, ...) |
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from loraplex.adapters import AdapterValidationError
from loraplex.platform.api.errors import INVALID_REQUEST, SERVER_ERROR, APIError
from loraplex.platform.api.quotas import QuotaDecision
from loraplex.platform.api.services.errors import Conflict, InvalidInput, NotFound, QuotaExceeded


class GatewayError(APIError):
    """An ``APIError`` that also sets response headers (``WWW-Authenticate``, ``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        err_type: str = INVALID_REQUEST,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, param=param, code=code, err_type=err_type)
        self.headers = dict(headers or {})


def unauthorized(message: str) -> GatewayError:
    """401 for a missing, malformed, wrong, revoked or expired credential (one message per cause
    the caller can fix: never which of wrong / revoked / expired it was)."""
    return GatewayError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def forbidden(message: str, code: str = "forbidden") -> GatewayError:
    return GatewayError(403, message, code=code)


def quota_refusal(decision: QuotaDecision) -> GatewayError:
    """The answer to a refused admission: 429 for a full limit, 503 while quotas cannot be checked."""
    headers = {} if decision.retry_after_header is None else {"Retry-After": decision.retry_after_header}
    if decision.reason == "unavailable":
        return GatewayError(
            503, decision.detail, code="quota_unavailable", err_type=SERVER_ERROR, headers=headers
        )
    kind = "tokens" if decision.reason in ("tpm", "request_over_tpm") else "requests"
    return GatewayError(429, decision.detail, code="rate_limit_exceeded", err_type=kind, headers=headers)


def to_gateway_error(exc: NotFound | Conflict | QuotaExceeded | InvalidInput) -> GatewayError:
    """The HTTP form of a service error."""
    if isinstance(exc, NotFound):
        if exc.kind == "model":
            return GatewayError(404, f"The model '{exc.name}' does not exist.", code="model_not_found")
        return GatewayError(404, f"The {exc.kind} '{exc.name}' does not exist.", code="not_found")
    if isinstance(exc, Conflict):
        return GatewayError(409, str(exc), code="conflict")
    if isinstance(exc, QuotaExceeded):
        status = 413 if exc.quota == "max_adapter_bytes" else 403
        return GatewayError(status, f"Tenant quota exceeded: {exc}.", param=exc.quota, code="quota_exceeded")
    return GatewayError(
        400, f"Invalid value for '{exc.field}': {exc.detail}.", param=exc.field, code="invalid_value"
    )


def rejected_adapter(exc: AdapterValidationError, hide: tuple[str, ...] = ()) -> GatewayError:
    """400 naming the rule an uploaded adapter broke; ``hide``: server paths to cut from the message."""
    message = exc.detail
    for path in hide:
        message = message.replace(path + "/", "").replace(path, "upload")
    return GatewayError(
        400, f"The adapter was rejected ({exc.reason}): {message}", param="file", code=exc.reason
    )


def install_gateway_error_handlers(app: FastAPI) -> None:
    """Route the gateway's exceptions to OpenAI's error body (after ``install_error_handlers``)."""

    @app.exception_handler(GatewayError)
    async def _gateway(_: Request, exc: GatewayError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def _service(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, NotFound | Conflict | QuotaExceeded | InvalidInput)
        err = to_gateway_error(exc)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    for service_error in (NotFound, Conflict, QuotaExceeded, InvalidInput):
        app.add_exception_handler(service_error, _service)

    @app.exception_handler(AdapterValidationError)
    async def _adapter(_: Request, exc: AdapterValidationError) -> JSONResponse:
        err = rejected_adapter(exc)
        return JSONResponse(err.body(), status_code=err.status)


def bad_request_field(param: str, message: str) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_value")
