"""``RequestStream``: one request's outputs, handed from the engine thread to an asyncio reader.

The engine thread never touches a stream directly: it schedules ``post`` on the stream's event
loop (``deliver``), so the stream's state is only ever read and written on that loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from loraplex.platform.engine.outputs import RequestOutput


class RequestStream:
    """One request's outputs, in order, until it finishes; ``abort()`` drops it.

    Iterating yields a ``RequestOutput`` after every step that advanced the request
    and stops after the finished one; it raises ``EngineDeadError`` if the engine
    dies meanwhile. ``abort()`` is synchronous, idempotent and safe in a cancelled task.

    The backlog is one output. With ``aggregate`` (the request's outputs are
    ``RequestOutputKind.DELTA``), an output not read yet absorbs the next one
    (``RequestOutput.add``: text, token ids and logprobs appended, the newest finish state), so
    nothing is lost and a reader that falls behind (a client that stopped reading its stream)
    gets everything since its last read in one output: its memory is what the engine generated
    meanwhile, once, not one output per step. Otherwise outputs are cumulative (or only the
    final one), and an unread one is replaced by the next. ``num_coalesced`` counts both. The
    finished output and an error are never replaced, nor merged into.
    """

    def __init__(
        self,
        abort: Callable[[str], None],
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        aggregate: bool = False,
    ) -> None:
        self._abort = abort  # the engine's abort: never blocks, safe from any thread
        self.request_id = request_id
        self.loop = loop
        self.aggregate = aggregate
        """The outputs are deltas: merge unread ones rather than keep the newest."""
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self.num_coalesced = 0
        """Outputs merged into (or replaced by) a newer one before they were read."""
        self.finished = False
        self.failure: BaseException | None = None
        """Set by ``fail``: raised by the next read, before any output still pending."""

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self.failure is None and self._pending is None:
            self._ready.clear()
            await self._ready.wait()
        item = self.failure if self.failure is not None else self._pending
        self._pending = None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        assert item is not None
        if item.finished:
            self.finished = True
        return item

    @property
    def pending(self) -> RequestOutput | BaseException | None:
        """The output (or error) posted and not read yet: what an unread request used so far."""
        return self._pending

    def post(self, item: RequestOutput | BaseException) -> None:
        """Hand the reader ``item`` (on the stream's loop): merged into an unread running output
        (``aggregate``), or replacing it; an error replaces it either way."""
        pending = self._pending
        if isinstance(pending, BaseException) or (pending is not None and pending.finished):
            return  # the end is known already: nothing after it matters
        if pending is not None:
            self.num_coalesced += 1
            if self.aggregate and isinstance(item, RequestOutput):
                # In place: the pending output is the stream's own until it is read.
                pending.add(item, aggregate=True)
                return
        self._pending = item
        self._ready.set()

    def abort(self) -> None:
        """Stop the request and free what it holds (a no-op once it finished)."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)

    def fail(self, error: BaseException) -> None:
        """End the request with ``error``: the reader gets it next (call on the stream's loop), the
        engine stops the request. A no-op once it finished."""
        if not self.finished and self.failure is None:
            self.failure = error
            self._ready.set()  # wakes a reader waiting for the next output
            self._abort(self.request_id)


def call_in(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    """Run ``callback`` on ``loop`` soon (from any thread); nothing if the loop is closed."""
    # A closed event loop (RuntimeError) means nobody is listening any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)


def deliver(stream: RequestStream, item: RequestOutput | BaseException) -> None:
    """Post ``item`` to ``stream`` on its own loop (from the engine thread)."""
    call_in(stream.loop, lambda: stream.post(item))


def resolve(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[None], error: BaseException | None
) -> None:
    """Settle an asyncio ``future`` of ``loop`` from another thread: done, or failed with ``error``
    (nothing if its waiter was cancelled meanwhile)."""

    def settle() -> None:
        if future.done():  # the caller was cancelled meanwhile
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    call_in(loop, settle)
