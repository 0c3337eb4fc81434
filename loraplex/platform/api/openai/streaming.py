"""Server-sent events: the chunks of a streamed response, and a response that watches the client.

A stream always ends with ``data: [DONE]``. A failure after the stream started
(a failed step, the engine dying) is sent as one event holding OpenAI's error body,
``data: {"error": {...}}``, before ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from loraplex.platform.api.errors import APIError, to_api_error
from loraplex.platform.api.openai.responses import ResponseShape, usage_of_counts
from loraplex.platform.api.openai.submission import abort_all, merged, step_failure
from loraplex.platform.api.openai.tool_stream import ToolStream
from loraplex.platform.engine.errors import EngineError
from loraplex.platform.engine.outputs import CompletionOutput, RequestOutput
from loraplex.platform.engine.request_stream import RequestStream

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, allow_nan=False)}\n\n"


class SSEResponse(StreamingResponse):
    """A streamed response that stops (and calls ``on_close``) as soon as the client leaves.

    Starlette only listens for the disconnect on servers older than ASGI 2.4 and
    otherwise notices it at the next write, which for a queued request may be
    minutes away; this always listens. ``on_close`` runs however the response ends,
    even if the body iterator never started (so its ``finally`` never ran).

    A client that stops reading (its socket stays open, its receive window full) makes a
    write wait; past ``write_timeout_s`` the response ends as if the client had left: the
    request is aborted and its slot, KV blocks and adapter pin are freed, rather than held
    until the engine reaches ``max_tokens`` or the socket closes.
    """

    def __init__(
        self, content: AsyncIterator[str], on_close: Callable[[], None], write_timeout_s: float | None = None
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close
        self._write_timeout_s = write_timeout_s
        self.write_timed_out = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout_s = self._write_timeout_s

        async def timed_send(message: Message) -> None:
            if timeout_s is None:
                await send(message)
                return
            with anyio.fail_after(timeout_s):
                await send(message)

        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    await self.stream_response(timed_send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        except* OSError:  # the socket closed under a write: the client left
            pass
        except* TimeoutError:
            self.write_timed_out = True
            logger.warning(
                "stream %s: the client read nothing for %.0f s; request aborted",
                scope.get("path", ""),
                timeout_s,
            )
        finally:
            self._on_close()


async def sse_events(
    shape: ResponseShape,
    streams: list[RequestStream],
    on_error: Callable[[APIError], None] | None = None,
) -> AsyncIterator[str]:
    """The events of a streamed request: deltas, the usage chunk if asked, then ``[DONE]``;
    ``streams`` carry ``RequestOutputKind.DELTA`` outputs; ``on_error`` hears the error of a
    failed stream (the metrics count it)."""
    err: APIError | None = None
    try:
        async for chunk in _chunks(shape, streams):
            yield chunk
    except (APIError, EngineError) as exc:
        err = to_api_error(exc)
    except Exception:
        logger.exception("stream %s failed", shape.request_id)
        err = to_api_error(RuntimeError())
    finally:
        abort_all(streams)
    if err is not None:
        if on_error is not None:
            on_error(err)
        yield event(err.body())
    yield DONE


class _Progress:
    """What one choice has sent: its logprobs' text offset, whether it started and ended, and the
    tokens whose text is not out yet (``held``: an incomplete character, a possible stop-string
    prefix), which go out with the next chunk of it that has text."""

    def __init__(self) -> None:
        self.text_offset = 0
        self.started = False
        self.finished = False
        self.held: CompletionOutput | None = None


class _Usage:
    """What one engine request used, summed from its deltas (the prompt is on the first only)."""

    def __init__(self) -> None:
        self.prompt = 0
        self.cached = 0
        self.completion = 0
        self.finished = False

    def add(self, out: RequestOutput) -> None:
        self.prompt = self.prompt or len(out.prompt_token_ids)
        self.cached = out.num_cached_tokens
        self.completion += sum(len(c.token_ids) for c in out.outputs)
        self.finished = out.finished


async def _chunks(shape: ResponseShape, streams: list[RequestStream]) -> AsyncIterator[str]:
    """The chunks of ``streams``, whose outputs are deltas (``RequestOutputKind.DELTA``): each
    holds only what is new, so a step costs what it generated. The engine holds back a possible
    stop-string prefix until the completion ends, so a stop string split across tokens is never
    half-sent; a delta with tokens but no text yet waits for the next one that has text."""
    tool_stream = ToolStream(shape.tools) if shape.tools is not None and shape.calls_tools else None
    progress: dict[int, _Progress] = {}
    used = [_Usage() for _ in streams]
    async for p, out in merged(streams):
        if out.error is not None:
            raise step_failure(out)
        used[p].add(out)
        choices = []
        for c in out.outputs:
            index = shape.choice_index(p, c)
            sent = progress.setdefault(index, _Progress())
            if sent.finished:  # its finish_reason went out already (siblings still run)
                continue
            if sent.held is not None:
                sent.held.add(c)
                c, sent.held = sent.held, None
            if not c.text and not c.finished():
                sent.held = c.copy()  # a copy of its own: the next deltas are added to it in place
                continue
            logprobs, sent.text_offset = shape.logprobs(c, 0, len(c.token_ids), sent.text_offset)
            if tool_stream is not None:
                # Tool calls go out as delta.tool_calls, one choice entry per chunk.
                for entry in tool_stream.choices(index, c.text, not sent.started, c):
                    yield event(shape.chunk([entry]))
            else:
                choices.append(shape.delta_choice(index, c.text, not sent.started, c.finish_reason, logprobs))
            sent.started = True
            sent.finished = c.finished()
        if choices:
            yield event(shape.chunk(choices))
    if shape.include_usage and all(u.finished for u in used):
        totals = [(u.prompt, u.cached, u.completion) for u in used]
        yield event(shape.chunk([], usage=usage_of_counts(totals)))
