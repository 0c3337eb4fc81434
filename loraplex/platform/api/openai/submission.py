"""The engine side of one HTTP request: submit its prompts, read their outputs, abort.

Every path out of a request (finished, refused, failed, client gone, server
stopping) aborts what it submitted: ``RequestStream.abort`` is synchronous, so it
also runs in the ``finally`` of a cancelled task. ``submit`` hands back ``MeteredStream``s,
which remember the last output read, so the gate can account for what a request used
however it ended, and when its tokens arrived (time to first token, inter-token gaps).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from loraplex.adapters import LoRARequest
from loraplex.platform.api.errors import APIError, request_error
from loraplex.platform.api.state import AppState
from loraplex.platform.engine.inputs import PromptType
from loraplex.platform.engine.outputs import RequestOutput
from loraplex.platform.engine.request_stream import RequestStream
from loraplex.platform.engine.sampling_params import SamplingParams


def step_failure(out: RequestOutput) -> APIError:
    """The error of a request the engine finished with ``error`` set: its status from the
    error's kind (``request_error``)."""
    assert out.error is not None, "only a failed output has an error to answer"
    return request_error(out.error)


class MeteredStream(RequestStream):
    """A ``RequestStream`` that remembers its request as read so far (``last``: what it used)
    and when its tokens were read: ``first_token_s`` (``time.monotonic``) and ``token_gaps_s``,
    one ``(seconds per token, tokens)`` entry per output that brought new tokens after the first.

    It reads through ``inner``, the stream the engine feeds and aborts; everything else
    delegates to it, so this is a ``RequestStream`` wherever one is expected.
    """

    def __init__(self, inner: RequestStream) -> None:
        # No super().__init__(): the queue and the engine stay the inner stream's own.
        self.inner = inner
        self.request_id = inner.request_id
        self.loop = inner.loop
        self.aggregate = inner.aggregate
        self.last: RequestOutput | None = None
        """The request as read so far: the last output read, or with ``aggregate`` (deltas) all
        of them merged (``RequestOutput.add``, into a copy: the reader keeps each delta)."""
        self.first_token_s: float | None = None
        self.token_gaps_s: list[tuple[float, int]] = []
        self._num_tokens = 0
        self._last_token_s = 0.0

    @property
    def finished(self) -> bool:
        return self.inner.finished

    @finished.setter
    def finished(self, value: bool) -> None:
        self.inner.finished = value

    @property
    def latest(self) -> RequestOutput | None:
        """The request as the engine posted it, read or not: what it used so far (a stalled
        reader's stream may hold a newer output than ``last``)."""
        pending = self.inner.pending
        if not isinstance(pending, RequestOutput):
            return self.last
        if not self.aggregate or self.last is None:
            return pending
        latest = self.last.copy()
        latest.add(pending, aggregate=True)
        return latest

    async def __anext__(self) -> RequestOutput:
        out = await self.inner.__anext__()
        if not self.aggregate:
            self.last = out
        elif self.last is None:
            self.last = out.copy()
        else:
            self.last.add(out, aggregate=True)
        num_tokens = sum(len(c.token_ids) for c in self.last.outputs)
        if num_tokens > self._num_tokens:
            now = time.monotonic()
            if self.first_token_s is None:
                # A final-only output (a non-streamed answer) is the first one read: the engine
                # says when its first token came, and its other tokens came in between.
                first = out.metrics.get("first_token_time") if out.finished else None
                self.first_token_s = now if first is None else first
                added = num_tokens - len(out.outputs)
                if first is not None and added > 0:
                    self.token_gaps_s.append((max(0.0, now - first) / added, added))
            else:
                added = num_tokens - self._num_tokens
                self.token_gaps_s.append(((now - self._last_token_s) / added, added))
            self._num_tokens, self._last_token_s = num_tokens, now
        return out

    def abort(self) -> None:
        self.inner.abort()

    def fail(self, error: BaseException) -> None:
        self.inner.fail(error)


async def submit(
    state: AppState,
    request_id: str,
    prompts: list[PromptType],
    params: SamplingParams,
    lora: LoRARequest | None,
    tenant_id: str | None = None,
    tenant_weight: float = 1.0,
) -> list[MeteredStream]:
    """Add one engine request per prompt, concurrently, as ``tenant_id`` (with its fair-share
    ``tenant_weight``), under the server's ``max_queued_requests`` and ``request_timeout_s``;
    all or none (a refusal, or the caller being cancelled, aborts the ones already accepted)."""
    engine = state.engine
    limits = state.limits
    options: dict[str, Any] = dict(
        lora_request=lora,
        tenant_id=tenant_id,
        tenant_weight=tenant_weight,
        timeout_s=limits.request_timeout_s or None,
        max_queued=limits.max_queued_requests,
    )
    if len(prompts) == 1:
        stream = await engine.add_request(request_id, prompts[0], params, **options)
        return [MeteredStream(stream)]
    tasks = [
        asyncio.ensure_future(engine.add_request(f"{request_id}-{i}", p, params, **options))
        for i, p in enumerate(prompts)
    ]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()  # a submission still in flight aborts itself when cancelled
            if task.done() and not task.cancelled() and task.exception() is None:
                task.result().abort()
        raise
    return [MeteredStream(task.result()) for task in tasks]


def abort_all(streams: Sequence[RequestStream]) -> None:
    for stream in streams:
        stream.abort()


async def collect(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """The final output of every stream (they run concurrently in the engine)."""
    finals: list[RequestOutput] = []
    for stream in streams:
        final: RequestOutput | None = None
        async for out in stream:
            final = out
        if final is None:
            raise RuntimeError(f"request {stream.request_id} ended without an output")
        if final.error is not None:
            raise step_failure(final)
        finals.append(final)
    return finals


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from all streams, in the order the outputs arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()
