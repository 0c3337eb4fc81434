"""Runs an ``LLMEngine`` in its own thread and streams outputs to asyncio callers.

The engine loop is synchronous (one forward per step); the HTTP layer is async.
Calls into the engine (add, abort, step) are serialised by one lock, so the
engine never sees two threads at once, and each request's outputs travel to its
caller through an ``asyncio.Queue`` fed with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from loraplex.platform.engine import LLMEngine
from loraplex.platform.outputs import RequestOutput
from loraplex.platform.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Thread-backed async facade: ``generate`` yields snapshots until finished."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._queues: dict[
            str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]
        ] = {}
        self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                busy = self.engine.has_unfinished_requests()
                outputs: list[RequestOutput] = []
                error: BaseException | None = None
                if busy:
                    try:
                        outputs = self.engine.step()
                    except Exception as exc:  # a failed step fails its requests, not the server
                        logger.exception("engine step failed")
                        error = exc
            if error is not None:
                self._fail_all(error)
            for out in outputs:
                target = self._queues.get(out.request_id)
                if target is not None:
                    loop, queue = target
                    loop.call_soon_threadsafe(queue.put_nowait, out)
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            for rid in list(self._queues):
                self.engine.abort_request(rid)
        for loop, queue in list(self._queues.values()):
            loop.call_soon_threadsafe(queue.put_nowait, error)

    def _add(self, request_id: str, prompt: str | list[int], params: SamplingParams, lora: Any) -> None:
        with self._lock:
            self.engine.add_request(request_id, prompt, params, lora_request=lora)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its state after every step that advanced it.

        Validation errors (``ValueError``) raise here before anything is queued. If
        the caller stops iterating (client went away), the request is aborted and
        its KV blocks are freed.
        """
        rid = request_id or f"req-{self.engine.next_request_id()}"
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            await asyncio.to_thread(self._add, rid, prompt, params, lora_request)
            self._wake.set()
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise RuntimeError("the engine failed while serving this request") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                await asyncio.to_thread(self.abort, rid)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort_request(request_id)
