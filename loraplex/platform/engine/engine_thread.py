"""``EngineThread``: the one thread that touches an ``LLMEngine``, and its inbox.

``AsyncEngine`` (the facade callers use) posts commands here from any thread (``post``); the
loop drains them in order before every step (``commands``: each applies itself), runs the step,
hands each request's outputs to its ``RequestStream`` on the stream's event loop, and runs the
maintenance jobs (purges, resets) in slices between steps. If a step raises, the engine's state
is unknown: every open request and every pending command fails with ``EngineDeadError`` and the
``on_dead`` callbacks run.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from loraplex.platform.engine.commands import EngineCommand
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.errors import EngineDeadError
from loraplex.platform.engine.host_memory import IdleTrim
from loraplex.platform.engine.outputs import RequestOutput
from loraplex.platform.engine.request_stream import RequestStream, deliver
from loraplex.storage.kv.sliced import SlicedJob

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 1.0
"""How long the idle engine thread sleeps between checks when nothing wakes it."""
MAINTENANCE_SLICE_S = 0.02
"""Engine time a purge or reset may take between two steps while requests run (a slice ends
after the piece that crosses it: one slot file erased, at most a few milliseconds). Idle, the
engine runs them in ``_IDLE_MAINTENANCE_S`` slices, reading its inbox in between."""
_IDLE_MAINTENANCE_S = 0.1
_JOB_POLL_S = 0.001
_ABORT_SETTLE_S = 0.01
"""After applying aborts, how long to wait for more before the next step. Disconnects
come in bursts (a client pool closing, a proxy restarting) that the event loop turns
into aborts over a few milliseconds; applying only the first few would let the next
step admit queued requests of the same burst and spend a whole prefill on them."""


class EngineThread:
    """The engine's thread: the inbox it drains, the streams it feeds, the jobs it slices."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._inbox: collections.deque[EngineCommand] = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        # Registered on the event loop, read and removed on the engine thread.
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._dead_callbacks: list[Callable[[BaseException], None]] = []
        self._changed = False  # commands ran since the last stats snapshot (engine thread only)
        # The future of each sliced job started (engine thread only); the engine's maintenance
        # queue owns the jobs and their order.
        self._jobs: dict[SlicedJob[Any], concurrent.futures.Future[Any]] = {}
        # Adds posted (event loop) and applied (engine thread), each written by one thread only:
        # their difference is the adds in the inbox, which the overload check counts as queued.
        self.num_adds_posted = 0
        self._num_adds_applied = 0
        self.error: BaseException | None = None
        """What stopped the loop (None while it runs, and after a clean shutdown)."""
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._thread.start()

    # -- the callers' side, any thread ---------------------------------------------------
    @property
    def stopped(self) -> bool:
        """The loop failed or was told to stop: nothing posted now would be applied."""
        return self.error is not None or self._stop.is_set()

    @property
    def is_alive(self) -> bool:
        return not self.stopped and self._thread.is_alive()

    @property
    def adds_in_flight(self) -> int:
        """Adds posted and not applied yet (the overload check counts them as queued)."""
        return self.num_adds_posted - self._num_adds_applied

    def dead_error(self) -> EngineDeadError:
        """What a caller is told once the loop stopped."""
        if self.error is None:
            return EngineDeadError("the server is shutting down")
        # The cause is logged; clients only learn that the server is restarting.
        return EngineDeadError("the engine stopped after an internal error; the server is restarting")

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` (on the engine thread) if the loop dies."""
        self._dead_callbacks.append(callback)
        if self.error is not None:
            callback(self.error)

    def post(self, command: EngineCommand) -> None:
        """Queue ``command`` for the loop (never blocks)."""
        self._inbox.append(command)
        self._wake.set()

    def register(self, stream: RequestStream) -> None:
        """Feed ``stream`` its request's outputs; ``ValueError`` if its id is in use."""
        with self._streams_lock:
            if stream.request_id in self._streams:
                raise ValueError(f"request_id {stream.request_id!r} is already in use")
            self._streams[stream.request_id] = stream

    def unregister(self, request_id: str) -> RequestStream | None:
        """Stop feeding ``request_id``'s stream (the one that was registered, if any)."""
        with self._streams_lock:
            return self._streams.pop(request_id, None)

    def stop(self, timeout_s: float) -> bool:
        """Stop the loop, wait for it up to ``timeout_s``, fail what is still open; True when the
        thread ended (only then may the engine itself be shut down)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s)
        self.fail_everything(EngineDeadError("the server is shutting down"))
        return not self._thread.is_alive()

    # -- the loop, on the engine thread ------------------------------------------------
    def _run(self) -> None:
        idle = IdleTrim()
        try:
            while not self._stop.is_set():
                if self._drain_inbox():
                    time.sleep(_ABORT_SETTLE_S)
                    self._drain_inbox()
                busy = self._engine.has_unfinished_requests()
                if self._jobs:
                    self._run_jobs(MAINTENANCE_SLICE_S if busy else _IDLE_MAINTENANCE_S)
                if self._changed:  # commands changed what the last snapshot says
                    self._changed = False
                    self._engine.publish_stats()
                if not busy:
                    if self._jobs:
                        # More slices, reading the inbox in between; a job waiting for its I/O
                        # workers yields at once, so do not spin on it.
                        self._wake.wait(timeout=_JOB_POLL_S)
                        self._wake.clear()
                        continue
                    idle.tick()
                    self._wake.wait(timeout=_IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                idle.busy()
                self._publish(self._engine.step())
        except BaseException as exc:
            logger.exception("the engine loop failed; no request can be served until a restart")
            self.error = exc
            self.fail_everything(self.dead_error())
            for callback in list(self._dead_callbacks):
                try:
                    callback(exc)
                except Exception:
                    logger.exception("an on_dead callback failed")

    def _run_jobs(self, budget_s: float) -> None:
        """One slice of the maintenance jobs; settle the futures of those that ended."""
        self._changed = True
        ended = self._engine.run_maintenance(budget_s)
        if ended:
            self._engine.publish_stats()  # the caller, woken below, may read the stats at once
        for job in ended:
            done = self._jobs.pop(job)
            if job.error is not None:  # the job's failure is its caller's error, not the loop's
                done.set_exception(job.error)
            else:
                done.set_result(job.result)

    def _drain_inbox(self) -> int:
        """Apply every posted command in order; return how many were aborts."""
        num_aborts = 0
        while self._inbox:
            command = self._inbox.popleft()
            self._changed = True
            command.apply(self)
            num_aborts += command.is_abort
        return num_aborts

    # -- what the commands use (``commands.EngineLoop``), on the engine thread ----------
    @property
    def engine(self) -> LLMEngine:
        return self._engine

    def is_open(self, request_id: str) -> bool:
        with self._streams_lock:
            return request_id in self._streams

    def close_stream(self, request_id: str) -> None:
        self.unregister(request_id)

    def add_applied(self) -> None:
        self._num_adds_applied += 1

    def track_job(self, job: SlicedJob[Any], done: concurrent.futures.Future[Any]) -> None:
        self._jobs[job] = done

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                stream = self.unregister(out.request_id)
                if stream is not None:
                    deliver(stream, out)
                continue
            with self._streams_lock:
                stream = self._streams.get(out.request_id)
            if stream is not None:
                deliver(stream, out)

    def fail_everything(self, error: EngineDeadError) -> None:
        """Fail every open request and every pending submission with ``error``."""
        with self._streams_lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            deliver(stream, error)
        while self._inbox:
            self._inbox.popleft().fail(error)
        jobs, self._jobs = self._jobs, {}
        for done in jobs.values():
            done.set_exception(error)
