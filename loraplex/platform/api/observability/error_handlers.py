"""The app's error handlers: every exception a route can raise answered with OpenAI's error body
(``errors.to_api_error``), and noted on the request's record first, where the metrics count
refusals by reason and the access log reads it."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from loraplex.platform.api.errors import MAPPED_ERRORS, APIError, to_api_error, validation_error
from loraplex.platform.api.observability.record import note_error

logger = logging.getLogger(__name__)


def error_response(request: Request, err: APIError) -> JSONResponse:
    """``err`` as OpenAI's error body, noted on the request's record first (where the metrics and
    the access log read it): every handler that answers an error goes through here."""
    note_error(request.scope, err)
    return err.response()


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception the app can raise to OpenAI's error body (and note it on the
    request's record, where the metrics count refusals by reason)."""

    answer = error_response

    async def _mapped(request: Request, exc: Exception) -> JSONResponse:
        return answer(request, to_api_error(exc))

    for error_class in MAPPED_ERRORS:
        app.add_exception_handler(error_class, _mapped)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(request, validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        detail = exc.detail if isinstance(exc.detail, str) else "error"
        message = f"{detail}: {request.method} {request.url.path}"
        err = APIError(
            exc.status_code, message, code=codes.get(exc.status_code), headers=dict(exc.headers or {})
        )
        return answer(request, err)

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, exc: ClientDisconnect) -> Response:
        # The client closed the connection while sending its body: nothing to answer, and not the
        # server's failure. Logged and counted as 499 (nginx's "client closed request"), not a 500.
        logger.info("client left while sending %s %s (499)", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises the exception after this response is sent, so the
        # server (uvicorn) logs its trace once; logging it here too would double it.
        return answer(request, to_api_error(exc))
