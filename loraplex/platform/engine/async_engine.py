"""Runs an ``LLMEngine`` in its own thread and streams outputs to asyncio callers.

``AsyncEngine`` is the only door into the engine from the server: the HTTP layer reads
what it needs through typed accessors (``tokenizer``, ``limits``, ``adapter_spec``) and
changes the engine only through commands (add, abort, adapters added and removed, the
prefix cache reset, a tenant's KV purged). Only the engine thread ever touches the engine's
state (``engine_thread``: its loop and inbox): commands (``commands``: objects that apply
themselves) go to an inbox that the thread drains before every step; each request's outputs
travel back through its own ``RequestStream`` (``request_stream``: a backlog of one output; a
newer one replaces an unread one, or with ``RequestOutputKind.DELTA`` is merged into it), fed
with ``call_soon_threadsafe``.
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
import concurrent.futures
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from loraplex.adapters import BaseModelSpec, LoRARequest
from loraplex.platform.engine.commands import AbortRequest, AddRequest, CallEngine, StartJob
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.engine_thread import EngineThread
from loraplex.platform.engine.errors import EngineDeadError, EngineOverloadedError, StructuredOutputError
from loraplex.platform.engine.limits import EngineLimits
from loraplex.platform.engine.outputs import RequestOutput
from loraplex.platform.engine.request_stream import RequestStream
from loraplex.platform.engine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from loraplex.platform.engine.stats import EngineStats
from loraplex.platform.engine.structured.bounds import COMPILE_TIMEOUT_S, COMPILE_WORKERS
from loraplex.storage.kv.sliced import SlicedJob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")


class AsyncEngine:
    """Thread-backed async facade over ``LLMEngine``: the server's only way to the engine."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        # Read once, before the engine thread starts: none of these change while it runs.
        self._limits = engine.limits
        self._adapter_spec = BaseModelSpec.from_hf_config(engine.hf_config)
        # Grammar compiles: a tenant's schema is compiled here, never on the event loop or the
        # engine thread; a few workers, so a hostile compile queues no more than a few others.
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=COMPILE_WORKERS, thread_name_prefix="loraplex-grammar-compile"
        )
        self._thread = EngineThread(engine)

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
    def error(self) -> BaseException | None:
        """What stopped the engine loop (None while it runs, and after a clean shutdown)."""
        return self._thread.error

    @property
    def is_alive(self) -> bool:
        """True while the engine loop runs and can serve requests."""
        return self._thread.is_alive

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` (on the engine thread) if the engine loop dies."""
        self._thread.on_dead(callback)

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
        delta = params.output_kind is RequestOutputKind.DELTA
        stream = RequestStream(self.abort, request_id, loop, aggregate=delta)
        self._thread.register(stream)
        accepted: asyncio.Future[None] = loop.create_future()
        self._thread.num_adds_posted += 1
        self._thread.post(
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
        if self._thread.stopped:
            # Stopped between the check and the post: the inbox may never be drained.
            self._thread.unregister(request_id)
            accepted.cancel()
            raise self._thread.dead_error()
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
        """Submit a request and yield its state after every step that advanced it (with
        ``RequestOutputKind.DELTA``: what is new since the last output yielded).

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
        self._thread.unregister(request_id)
        self._thread.post(AbortRequest(request_id))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block on every tier (``LLMEngine.reset_prefix_cache``), in
        slices between steps; False while requests are unfinished (commands posted before it
        run first)."""
        return await self._run_job(lambda engine: engine.start_reset_prefix_cache()) is not None

    async def purge_tenant(self, tenant_id: str) -> tuple[int, int, int]:
        """Forget one tenant's cached KV on every tier (``LLMEngine.purge_tenant``), in slices of
        at most ~``engine_thread.MAINTENANCE_SLICE_S`` between steps; (device, host, disk) blocks
        forgotten."""
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
        self._thread.post(CallEngine(fn, done))
        if self._thread.stopped:
            done.cancel()  # stopped meanwhile: the inbox may never be drained
            raise self._thread.dead_error()
        result: T = await asyncio.wrap_future(done)
        return result

    async def _run_job(self, start: Callable[[LLMEngine], SlicedJob[Any] | None]) -> Any:
        """Start a sliced job on the engine thread and wait for its result (None if not started)."""
        self._check_alive()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._thread.post(StartJob(start, done))
        if self._thread.stopped:
            done.cancel()
            raise self._thread.dead_error()
        return await asyncio.wrap_future(done)

    def shutdown(self) -> None:
        """Stop the engine loop; open requests fail with ``EngineDeadError``."""
        ended = self._thread.stop(timeout_s=30)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        if ended:
            self._engine.shutdown()  # persist cached KV to the disk tier for a warm restart

    def _check_queue(self, max_queued: int) -> None:
        """Refuse at once when the queue is full by the last snapshot plus the adds in flight."""
        queued = self._engine.stats.num_waiting + self._thread.adds_in_flight
        if queued >= max_queued:
            self._engine.rejections.count("overload")
            raise EngineOverloadedError(queued, max_queued)

    def _check_alive(self) -> None:
        if self._thread.stopped:
            raise self._thread.dead_error()
