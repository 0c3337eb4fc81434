"""The client side of one HTTP request: run it while the client is there, answer it.

A client that goes away is noticed at once, streaming or not, queued or running:
the work for it is cancelled and everything it submitted is aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from loraplex.adapters import LoRARequest
from loraplex.platform.api.deps import ServerState
from loraplex.platform.api.protocol import Prompt
from loraplex.platform.api.responses import ResponseShape
from loraplex.platform.api.streaming import SSEResponse, sse_events
from loraplex.platform.api.submission import abort_all, collect, submit
from loraplex.platform.engine.async_engine import RequestStream
from loraplex.platform.engine.outputs import RequestOutput
from loraplex.platform.engine.sampling_params import SamplingParams

T = TypeVar("T")

CLIENT_CLOSED = 499
"""Status logged for a request whose client left before the answer (nginx's convention)."""


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection.

    Once the body is read, the server's ``receive`` only answers ``http.disconnect``
    (uvicorn when the socket closes, test transports when the response completes).
    """
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """Run ``work``; if the client leaves first, cancel it and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return None
    finally:
        # Cancelling runs ``work``'s own finally (its aborts) even if nobody awaits it.
        task.cancel()
        watcher.cancel()


async def respond(
    request: Request,
    state: ServerState,
    shape: ResponseShape,
    prompts: list[Prompt],
    params: SamplingParams,
    lora: LoRARequest | None,
    stream: bool,
) -> Response:
    """Run ``prompts`` and answer with the whole response or an SSE stream."""
    if stream:
        streams = await until_disconnected(request, submit(state, shape.request_id, prompts, params, lora))
        if streams is None:
            return Response(status_code=CLIENT_CLOSED)
        return SSEResponse(
            sse_events(shape, streams, params.stop_strings), on_close=lambda: abort_all(streams)
        )

    async def run() -> list[RequestOutput]:
        streams: list[RequestStream] = []
        try:
            streams = await submit(state, shape.request_id, prompts, params, lora)
            return await collect(streams)
        finally:
            abort_all(streams)

    finals = await until_disconnected(request, run())
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(shape.response(finals))
