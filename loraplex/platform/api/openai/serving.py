"""The client side of one HTTP request: run it while the client is there, answer it.

A client that goes away is noticed at once, streaming or not, queued or running:
the work for it is cancelled and everything it submitted is aborted.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import Response

from loraplex.platform.api.errors import bad_request
from loraplex.platform.api.observability.record import record_of
from loraplex.platform.api.openai.beam_search import BeamProgress, beam_search, check_beam_width
from loraplex.platform.api.openai.responses import ResponseShape
from loraplex.platform.api.openai.streaming import SSEResponse, sse_events
from loraplex.platform.api.openai.submission import MeteredStream, abort_all, collect, submit
from loraplex.platform.api.state import AppState
from loraplex.platform.api.tenancy.gate import Admission, GatedCall, ModelTarget, PromptSource, RequestEnd
from loraplex.platform.engine.beam_rule import BeamSearchParams
from loraplex.platform.engine.outputs import RequestOutput
from loraplex.platform.engine.request_stream import RequestStream
from loraplex.platform.engine.sampling_params import RequestOutputKind, SamplingParams

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


def _end_of(streams: list[MeteredStream]) -> RequestEnd:
    """How a set of streams ended, from the last output read from each."""
    lasts = [s.last for s in streams]
    if any(out is not None and out.error is not None for out in lasts):
        return "error"
    if lasts and all(out is not None and out.finished for out in lasts):
        return "ok"
    return "aborted"


async def respond(
    request: Request,
    state: AppState,
    call: GatedCall,
    shape: ResponseShape,
    prompts: PromptSource,
    params: SamplingParams,
    target: ModelTarget,
    stream: bool,
    beam: BeamSearchParams | None = None,
) -> Response:
    """Admit ``prompts`` through the caller's gate, run them, answer whole or as an SSE stream;
    with ``beam``, search ``beam.beam_width`` beams per prompt (``params.n`` of them, as admitted).

    From admission on, every way out closes the admission once, with what the streams read.
    """
    if not stream:
        check_answer_size(state, params, len(prompts) if isinstance(prompts, list) else 1)
    if beam is not None:
        check_beam_width(state, beam)
    streams: list[MeteredStream] = []
    record = record_of(request.scope)
    if record is not None:
        record.model, record.stream, record.streams = target.model, stream, streams
        record.adapter = None if target.lora is None else target.model
    admission = await call.admit(shape.request_id, target, prompts, params)
    if record is not None and state.settings.serving.access_log_prompts:
        # A deferred source (a chat template) exists as prompts only once admitted.
        record.prompts = prompts if isinstance(prompts, list) else admission.prompts

    async def run_submit() -> list[MeteredStream]:
        streams.extend(
            await submit(
                state,
                shape.request_id,
                admission.prompts,
                params,
                target.lora,
                admission.tenant_id,
                admission.tenant_weight,
            )
        )
        admission.bind(streams)
        return streams

    if stream:
        # Each output carries only what is new (a step costs what it generated, not a copy of
        # the answer so far); an unread one absorbs the next, so a stalled reader loses nothing.
        params.output_kind = RequestOutputKind.DELTA
        try:
            submitted = await until_disconnected(request, run_submit())
        except BaseException:
            admission.close([], "error")
            raise
        if submitted is None:
            admission.close([], "aborted")
            return Response(status_code=CLIENT_CLOSED)

        def on_close() -> None:
            abort_all(submitted)
            # ``latest``: a stalled reader's request used more than it read; it pays for that.
            admission.close([s.latest for s in submitted], _end_of(submitted))

        readers: list[RequestStream] = [*submitted]
        on_error = None if record is None else record.failed
        write_timeout_s = state.limits.stream_write_timeout_s or None
        return SSEResponse(
            sse_events(shape, readers, on_error),
            on_close=on_close,
            write_timeout_s=write_timeout_s,
        )

    if beam is not None:
        return await _respond_beams(request, state, shape, admission, beam, target)

    # Nobody reads a non-streamed answer before it ends: the engine posts only the final output.
    params.output_kind = RequestOutputKind.FINAL_ONLY

    async def run() -> list[RequestOutput]:
        try:
            return await collect(await run_submit())
        finally:
            abort_all(streams)

    end: RequestEnd = "error"
    try:
        finals = await until_disconnected(request, run())
        end = "ok" if finals is not None else "aborted"
    finally:
        admission.close([s.last for s in streams], end)
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    # Built and encoded in a worker thread: a whole answer with logprobs is up to
    # ``max_response_logprobs`` entries, seconds of Python that would stall every other request.
    # One at a time: the build holds the GIL, so two at once finish no sooner, and every thread
    # that wants the GIL (the event loop, the engine at each torch call) waits behind each of them.
    body = await anyio.to_thread.run_sync(_encode, shape, finals, limiter=_builder())
    return Response(body, media_type="application/json")


async def _respond_beams(
    request: Request,
    state: AppState,
    shape: ResponseShape,
    admission: Admission,
    beam: BeamSearchParams,
    target: ModelTarget,
) -> Response:
    """The answer of a beam search: its best beams as the ``n`` choices of each prompt. Usage
    counts each prompt once and the tokens of the beams returned (vLLM's accounting), though
    every search step ran one request per beam; a search that ends early counts its running
    beams' tokens so far, as an aborted plain request counts what it generated."""
    progress = BeamProgress()
    search = beam_search(
        state,
        shape.request_id,
        admission.prompts,
        beam,
        target.lora,
        admission.tenant_id,
        admission.tenant_weight,
        progress,
    )
    end: RequestEnd = "error"
    finals: list[RequestOutput] | None = None
    try:
        finals = await until_disconnected(request, search)
        end = "ok" if finals is not None else "aborted"
    finally:
        admission.close(finals or progress.so_far(), end)
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    body = await anyio.to_thread.run_sync(_encode, shape, finals, limiter=_builder())
    return Response(body, media_type="application/json")


_BUILDERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = (
    weakref.WeakKeyDictionary()
)


def _builder() -> anyio.CapacityLimiter:
    """The one worker slot for building whole answers, per event loop (a limiter is bound to one)."""
    loop = asyncio.get_running_loop()
    limiter = _BUILDERS.get(loop)
    if limiter is None:
        limiter = _BUILDERS[loop] = anyio.CapacityLimiter(1)
    return limiter


_CHOICES = "\u0000choices\u0000"
"""Stands for the choices in the answer's frame while that is encoded (no client text holds it: it
is encoded as an escape, never as this raw string)."""


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def _encode(shape: ResponseShape, finals: list[RequestOutput]) -> bytes:
    """The whole answer as JSON bytes, exactly as ``JSONResponse`` renders it, one choice per
    ``json.dumps``: the C encoder holds the GIL for a whole call, so one call over a 15 MB answer
    would stall the event loop even from a worker thread; a choice at a time lets it run between."""
    payload = shape.response(finals)
    choices = payload["choices"]
    payload["choices"] = _CHOICES
    before, after = _dumps(payload).split(_dumps(_CHOICES), 1)
    parts = [before, "["]
    for i, choice in enumerate(choices):
        parts.append("," + _dumps(choice) if i else _dumps(choice))
    parts += ["]", after]
    return "".join(parts).encode("utf-8")


def check_answer_size(state: AppState, params: SamplingParams, num_prompts: int) -> None:
    """Refuse (400) a non-streamed answer that could hold more than ``max_response_logprobs``
    logprob entries: n x prompts x max_tokens x (1 + top logprobs), before anything runs."""
    if params.logprobs is None:
        return
    max_tokens = params.max_tokens if params.max_tokens is not None else state.engine.limits.max_model_len
    entries = params.n * num_prompts * max_tokens * (1 + params.logprobs)
    cap = state.limits.max_response_logprobs
    if entries > cap:
        raise bad_request(
            f"This answer could hold {entries} logprob entries (n x prompts x max_tokens x "
            f"(1 + top logprobs)), over this server's limit of {cap} for a whole answer; lower n, "
            "max_tokens or the number of logprobs, or stream it (stream=true).",
            "max_tokens",
        )
