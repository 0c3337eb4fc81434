"""Commands to the engine thread: each one an object that applies itself to the engine.

``AsyncEngine`` posts them to its inbox from any thread; the engine thread applies them in the
order posted, between steps (``EngineCommand.apply``). A command never fails the engine loop:
its error goes back to whoever posted it. When the engine stops, every command still in the
inbox is failed with the engine's error (``EngineCommand.fail``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from loraplex.adapters import LoRARequest
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.errors import EngineOverloadedError
from loraplex.platform.engine.request_stream import call_in, resolve
from loraplex.platform.engine.sampling_params import SamplingParams
from loraplex.storage.kv.sliced import SlicedJob

logger = logging.getLogger(__name__)


class EngineLoop(Protocol):
    """What a command may use on the engine thread besides the engine itself."""

    @property
    def engine(self) -> LLMEngine: ...

    def is_open(self, request_id: str) -> bool:
        """Whether a stream is still registered for ``request_id`` (not aborted meanwhile)."""

    def close_stream(self, request_id: str) -> None:
        """Forget ``request_id``'s stream (its request was refused)."""

    def add_applied(self) -> None:
        """Count one add applied (the overload check counts adds still in the inbox)."""

    def track_job(self, job: SlicedJob[Any], done: concurrent.futures.Future[Any]) -> None:
        """Run ``job`` between steps until it ends, then settle ``done`` with its result."""


class EngineCommand(Protocol):
    is_abort: bool
    """Aborts come in bursts: the loop waits a moment for more after applying one."""

    def apply(self, loop: EngineLoop) -> None:
        """Do it, on the engine thread; errors go to the poster, never out of here."""

    def fail(self, error: BaseException) -> None:
        """Never applied (the engine stopped): tell the poster ``error``."""


@dataclass
class AddRequest:
    """Queue a request whose caller awaits ``accepted`` on ``loop``."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None
    priority: int
    tenant_id: str | None
    tenant_weight: float
    timeout_s: float | None
    max_queued: int | None
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future[None]
    is_abort = False

    def apply(self, loop: EngineLoop) -> None:
        loop.add_applied()
        if not loop.is_open(self.request_id):  # aborted before it was added: its abort follows
            call_in(self.loop, self.accepted.cancel)
            return
        engine = loop.engine
        try:
            num_waiting = len(engine.scheduler.waiting)
            if self.max_queued is not None and num_waiting >= self.max_queued:
                engine.rejections.count("overload")
                raise EngineOverloadedError(num_waiting, self.max_queued)
            engine.add_request(
                self.request_id,
                self.prompt,
                self.params,
                lora_request=self.lora_request,
                priority=self.priority,
                tenant_id=self.tenant_id,
                tenant_weight=self.tenant_weight,
                timeout_s=self.timeout_s,
            )
        except Exception as exc:  # refused: the caller gets the error (typed ones become 4xx)
            loop.close_stream(self.request_id)
            resolve(self.loop, self.accepted, exc)
        else:
            resolve(self.loop, self.accepted, None)

    def fail(self, error: BaseException) -> None:
        resolve(self.loop, self.accepted, error)


@dataclass
class AbortRequest:
    """Stop a request and free what it holds (a no-op for one that finished)."""

    request_id: str
    is_abort = True

    def apply(self, loop: EngineLoop) -> None:
        loop.engine.abort_request(self.request_id)

    def fail(self, error: BaseException) -> None:
        pass  # nothing waits for an abort


@dataclass
class CallEngine:
    """Run ``fn(engine)`` between steps; its result (or error) goes to ``done``."""

    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future[Any]
    is_abort = False

    def apply(self, loop: EngineLoop) -> None:
        if not self.done.set_running_or_notify_cancel():
            return
        try:
            self.done.set_result(self.fn(loop.engine))
        except Exception as exc:  # a failed call is the caller's error, not the loop's
            logger.debug("an engine command from the server failed: %r", exc)
            self.done.set_exception(exc)

    def fail(self, error: BaseException) -> None:
        if self.done.set_running_or_notify_cancel():
            self.done.set_exception(error)


@dataclass
class StartJob:
    """Start a sliced job (``start(engine)``; None: nothing to do); it then runs between steps,
    and its result (or error) goes to ``done`` when it ends."""

    start: Callable[[LLMEngine], SlicedJob[Any] | None]
    done: concurrent.futures.Future[Any]
    is_abort = False

    def apply(self, loop: EngineLoop) -> None:
        if not self.done.set_running_or_notify_cancel():
            return
        try:
            job = self.start(loop.engine)
        except Exception as exc:
            self.done.set_exception(exc)
            return
        if job is None:
            self.done.set_result(None)
        else:
            loop.track_job(job, self.done)

    def fail(self, error: BaseException) -> None:
        if self.done.set_running_or_notify_cancel():
            self.done.set_exception(error)
