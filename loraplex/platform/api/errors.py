"""Every error the server returns, in OpenAI's body: ``{"error": {message, type, param, code}}``.

Only the engine's own errors (``loraplex.platform.engine.errors``) and this layer's
``APIError`` become client errors; anything else is a bug and a 500.

| raised | status | ``type`` / ``code`` |
|---|---|---|
| ``APIError`` | its own | its own (400 bad input, 413 body too large, ...) |
| ``InvalidParameterError`` | 400 | invalid_request_error / invalid_value |
| ``UnknownAdapterError`` | 404 | invalid_request_error / model_not_found |
| ``EngineDeadError`` | 503 | server_error / engine_dead |
| FastAPI's own: unknown route, wrong method, bad parameter (422) | 404, 405, 400 | invalid_request_error |
| anything else | 500 | server_error / internal_error |

``RequestTooLargeError`` and ``AdapterUnavailableError`` are ``InvalidParameterError``s.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.platform.engine.errors import (
    EngineDeadError,
    InvalidParameterError,
    UnknownAdapterError,
)

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


def error_body(
    message: str, err_type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error envelope (``code`` is a short string such as ``model_not_found``, or None)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class APIError(Exception):
    """An error the HTTP layer itself decides on (bad body, a limit, an unsupported field)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        err_type: str = INVALID_REQUEST,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 naming the offending field."""
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str = "") -> APIError:
    """A 400 for an OpenAI field this server does not implement (refused, never ignored)."""
    detail = f" {what}" if what else ""
    return APIError(
        400, f"'{param}' is not supported by this server{detail}.", param=param, code="unsupported_parameter"
    )


def to_api_error(exc: BaseException) -> APIError:
    """The client-facing form of ``exc``; unknown exceptions become a 500 without details."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidParameterError):
        return APIError(400, exc.message, param=exc.param, code="invalid_value")
    if isinstance(exc, UnknownAdapterError):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc) or "the engine has stopped", code="engine_dead", err_type=SERVER_ERROR)
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


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception the app can raise to OpenAI's error body."""

    def respond(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(InvalidParameterError)
    async def _invalid(_: Request, exc: InvalidParameterError) -> JSONResponse:
        return respond(to_api_error(exc))

    @app.exception_handler(UnknownAdapterError)
    async def _unknown_model(_: Request, exc: UnknownAdapterError) -> JSONResponse:
        return respond(to_api_error(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return respond(to_api_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        detail = exc.detail if isinstance(exc.detail, str) else "error"
        message = f"{detail}: {request.method} {request.url.path}"
        err = APIError(exc.status_code, message, code=codes.get(exc.status_code))
        return respond(err, dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises the exception after this response is sent, so the
        # server (uvicorn) logs its trace once; logging it here too would double it.
        return respond(to_api_error(exc))
