"""Runs an ``LLMEngine`` in its own thread and streams outputs to asyncio callers.

``AsyncEngine`` is the only door into the engine from the server: the HTTP layer reads
what it needs through typed accessors (``tokenizer``, ``limits``, ``adapter_spec``) and
changes the engine only through commands (add, abort, adapters added and removed, the
prefix cache reset, a tenant's KV purged). Only the engine thread ever touches the engine's
state: commands (``commands``: objects that apply themselves) go to an inbox that the thread
drains before every step; each request's outputs travel back through its own ``RequestStream``
(``request_stream``: a backlog of one output, a newer one replaces an unread one), fed with
``call_soon_threadsafe``.
The one exception is reading (staging) an adapter's files, which changes nothing the engine
serves and runs in a worker thread so the engine never waits for a disk read.

Why an inbox rather than a lock around the engine: an abort must work from a
``finally`` that runs inside a cancelled task (the client went away), where nothing
can be awaited, so ``abort`` is a plain synchronous call that never blocks; and the
event loop never waits behind a step. Commands are applied in the order posted, so
an abort posted while its add is still in flight is applied after the add.

Failures: a step that fails some requests returns them finished with
``RequestOutput.error`` set, and the loop goes on. If ``step()`` itself raises, the
engine's state is unknown: every request fails with ``EngineDeadError``, later
submissions are refused, and the ``on_dead`` callbacks run (the server stops).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from loraplex.adapters import BaseModelSpec, LoRARequest
from loraplex.platform.engine.commands import AbortRequest, AddRequest, CallEngine, EngineCommand, StartJob
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.errors import EngineDeadError, EngineOverloadedError, StructuredOutputError
from loraplex.platform.engine.host_memory import IdleTrim
from loraplex.platform.engine.limits import EngineLimits
from loraplex.platform.engine.outputs import RequestOutput
from loraplex.platform.engine.request_stream import RequestStream, deliver
from loraplex.platform.engine.sampling_params import SamplingParams, StructuredOutputsParams
from loraplex.platform.engine.stats import EngineStats
from loraplex.platform.engine.structured.bounds import COMPILE_TIMEOUT_S, COMPILE_WORKERS
from loraplex.storage.kv.sliced import SlicedJob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

T = TypeVar("T")

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


class AsyncEngine:
    """Thread-backed async facade over ``LLMEngine``: the server's only way to the engine."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        # Read once, before the engine thread starts: none of these change while it runs.
        self._limits = engine.limits
        self._adapter_spec = BaseModelSpec.from_hf_config(engine.hf_config)
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
        self._num_adds_posted = 0
        self._num_adds_applied = 0
        # Grammar compiles: a tenant's schema is compiled here, never on the event loop or the
        # engine thread; a few workers, so a hostile compile queues no more than a few others.
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=COMPILE_WORKERS, thread_name_prefix="loraplex-grammar-compile"
        )
        self.error: BaseException | None = None
        """What stopped the engine loop (None while it runs, and after a clean shutdown)."""
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._thread.start()

    # -- what the server reads -------------------------------------------------------
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's tokenizer (read-only: templating and token texts, on any thread)."""
        return self._engine.tokenizer

    @property
    def limits(self) -> EngineLimits:
        """The model's and the engine's limits (context length, ``max_num_seqs``, LoRA rank, ...)."""
        return self._limits

    @property
    def adapter_spec(self) -> BaseModelSpec:
        """The base model's LoRA-able layers: what an uploaded adapter is checked against."""
        return self._adapter_spec

    @property
    def stats(self) -> EngineStats:
        """The engine after its last step (or command): one consistent snapshot, never blocking."""
        return self._engine.stats

    async def tokenize(self, prompt: str) -> list[int]:
        """Token ids of a text prompt, as the engine counts them (in a worker thread)."""
        return await asyncio.to_thread(self._engine.tokenize, prompt)

    def next_request_id(self) -> str:
        return self._engine.next_request_id()

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile ``spec`` into the engine's grammar cache, in a worker thread (llguidance drops
        the GIL), so ``add_request`` finds it compiled. Raises ``StructuredOutputError`` naming the
        problem: invalid, over the bounds, or not compiled within ``COMPILE_TIMEOUT_S`` (the
        compile goes on in its worker until llguidance's fuel ends it; its result is cached)."""
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._grammar_pool, self._engine.grammars.compile, spec)
        try:
            await asyncio.wait_for(asyncio.shield(work), COMPILE_TIMEOUT_S)
        except TimeoutError:
            raise StructuredOutputError(
                f"{spec.param}: the constraint did not compile within {COMPILE_TIMEOUT_S:g} s; simplify it",
                param=spec.param,
            ) from None

    # -- caller side -----------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        """True while the engine loop runs and can serve requests."""
        return self.error is None and not self._stop.is_set() and self._thread.is_alive()

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` (on the engine thread) if the engine loop dies."""
        self._dead_callbacks.append(callback)
        if self.error is not None:
            callback(self.error)

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        tenant_id: str | None = None,
        tenant_weight: float = 1.0,
        timeout_s: float | None = None,
        max_queued: int | None = None,
    ) -> RequestStream:
        """Submit a request; returns once the engine accepted it.

        Raises the engine's typed errors (``InvalidParameterError``, ...) if it refused
        it, ``EngineDeadError`` if the engine is not running. A text prompt is
        tokenized here, off the event loop and off the engine thread. ``tenant_weight`` is its
        tenant's fair share, ``timeout_s`` its deadline (``LLMEngine.add_request``). With
        ``max_queued``, ``EngineOverloadedError`` when that many sequences wait already (or are
        on their way in): refused at once, from the last snapshot, and checked again exactly
        on the engine thread; nothing is queued.
        """
        self._check_alive()
        if max_queued is not None:
            self._check_queue(max_queued)
        if isinstance(prompt, str):
            prompt = await self.tokenize(prompt)
        loop = asyncio.get_running_loop()
        stream = RequestStream(self.abort, request_id, loop)
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
        accepted: asyncio.Future[None] = loop.create_future()
        self._num_adds_posted += 1
        self._post(
            AddRequest(
                request_id,
                prompt,
                params,
                lora_request,
                priority,
                tenant_id,
                tenant_weight,
                timeout_s,
                max_queued,
                loop,
                accepted,
            )
        )
        if self.error is not None or self._stop.is_set():
            # Stopped between the check and the post: the inbox may never be drained.
            self._unregister(request_id)
            accepted.cancel()
            raise self._dead_error()
        try:
            await accepted
        except BaseException:
            # Refused (the engine already forgot it) or cancelled (the caller left):
            # either way, make sure nothing keeps running for it.
            stream.abort()
            raise
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        tenant_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its state after every step that advanced it.

        If the caller stops iterating (or is cancelled), the request is aborted.
        """
        rid = request_id or f"req-{self.next_request_id()}"
        stream = await self.add_request(rid, prompt, params, lora_request, tenant_id=tenant_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request: never blocks, safe from any thread and in cancelled tasks."""
        self._unregister(request_id)
        self._post(AbortRequest(request_id))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block on every tier (``LLMEngine.reset_prefix_cache``), in
        slices between steps; False while requests are unfinished (commands posted before it
        run first)."""
        return await self._run_job(lambda engine: engine.start_reset_prefix_cache()) is not None

    async def purge_tenant(self, tenant_id: str) -> tuple[int, int, int]:
        """Forget one tenant's cached KV on every tier (``LLMEngine.purge_tenant``), in slices of
        at most ~``MAINTENANCE_SLICE_S`` between steps; (device, host, disk) blocks forgotten."""
        result: tuple[int, int, int] = await self._run_job(
            lambda engine: engine.start_purge_tenant(tenant_id)
        )
        return result

    async def add_lora(
        self, lora: LoRARequest, owner: str | None = None, served_name: str | None = None
    ) -> None:
        """Validate and register an adapter: its files are read in a worker thread, then the
        engine thread registers it between steps. Raises the adapter's typed errors
        (``AdapterValidationError``, ``AdapterExistsError`` for an id or name taken by other content).
        ``served_name``: what clients call it when that is not ``lora.name`` (metrics, KV events)."""
        self._check_alive()
        staged = await asyncio.to_thread(self._engine.stage_lora, lora)
        try:
            await self._call(lambda engine: engine.register_lora(lora, staged, owner, served_name))
        except EngineDeadError:
            self._engine.discard_staged_lora(staged)
            raise

    async def remove_lora(self, int_id: int) -> None:
        """Refuse new requests for adapter ``int_id`` (running ones finish on its weights), between
        steps; raises ``AdapterError`` if it is not registered."""
        await self._call(lambda engine: engine.remove_lora(int_id))

    async def list_loras(self) -> list[int]:
        """Ids of the registered adapters."""
        return await self._call(lambda engine: engine.list_loras())

    async def lora_tiers(self) -> dict[int, str]:
        """Where each registered adapter is now, by id: ``device`` (a slot), ``host`` or ``disk``."""
        return await self._call(lambda engine: engine.lora_tiers())

    async def inspect(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result: the
        one safe way for a test or a diagnostic to read the engine's internals while it runs
        (reading them from another thread races the step). ``fn`` must only read."""
        return await self._call(fn)

    async def _call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; its result or its error."""
        self._check_alive()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._post(CallEngine(fn, done))
        if self.error is not None or self._stop.is_set():
            done.cancel()  # stopped meanwhile: the inbox may never be drained
            raise self._dead_error()
        result: T = await asyncio.wrap_future(done)
        return result

    async def _run_job(self, start: Callable[[LLMEngine], SlicedJob[Any] | None]) -> Any:
        """Start a sliced job on the engine thread and wait for its result (None if not started)."""
        self._check_alive()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._post(StartJob(start, done))
        if self.error is not None or self._stop.is_set():
            done.cancel()
            raise self._dead_error()
        return await asyncio.wrap_future(done)

    def shutdown(self) -> None:
        """Stop the engine loop; open requests fail with ``EngineDeadError``."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        self._fail_everything(EngineDeadError("the server is shutting down"))
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            self._engine.shutdown()  # persist cached KV to the disk tier for a warm restart

    def _check_queue(self, max_queued: int) -> None:
        """Refuse at once when the queue is full by the last snapshot plus the adds in flight."""
        queued = self._engine.stats.num_waiting + (self._num_adds_posted - self._num_adds_applied)
        if queued >= max_queued:
            self._engine.rejections.count("overload")
            raise EngineOverloadedError(queued, max_queued)

    def _check_alive(self) -> None:
        if self.error is not None or self._stop.is_set():
            raise self._dead_error()

    def _dead_error(self) -> EngineDeadError:
        if self.error is None:
            return EngineDeadError("the server is shutting down")
        # The cause is logged; clients only learn that the server is restarting.
        return EngineDeadError("the engine stopped after an internal error; the server is restarting")

    def _post(self, command: EngineCommand) -> None:
        self._inbox.append(command)
        self._wake.set()

    def _unregister(self, request_id: str) -> RequestStream | None:
        with self._streams_lock:
            return self._streams.pop(request_id, None)

    # -- engine thread -----------------------------------------------------------------
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
            self._fail_everything(self._dead_error())
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
        self._unregister(request_id)

    def add_applied(self) -> None:
        self._num_adds_applied += 1

    def track_job(self, job: SlicedJob[Any], done: concurrent.futures.Future[Any]) -> None:
        self._jobs[job] = done

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                stream = self._unregister(out.request_id)
                if stream is not None:
                    deliver(stream, out)
                continue
            with self._streams_lock:
                stream = self._streams.get(out.request_id)
            if stream is not None:
                deliver(stream, out)

    def _fail_everything(self, error: EngineDeadError) -> None:
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
