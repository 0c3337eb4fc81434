"""The engine loop: schedule -> execute -> sample -> stop checks -> outputs.

``LLMEngine`` is synchronous and single-threaded; the offline ``LLM`` API drives
it directly and the server runs it in its own thread. One ``step()`` runs one
forward over every scheduled sequence, whatever mix of prefill chunks and decodes
(and, with LoRA, adapters) the scheduler picked.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from types import MappingProxyType
from typing import Any

import torch

from loraplex.adapters import StagedAdapter
from loraplex.adapters.request import LoRARequest
from loraplex.platform.engine.assembly import assemble
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.draft_model import load_draft_proposer
from loraplex.platform.engine.errors import (
    AdapterUnavailableError,
    ErrorKind,
    InvalidParameterError,
    RequestError,
)
from loraplex.platform.engine.kv_events.stream import KVEventStream
from loraplex.platform.engine.limits import EngineLimits
from loraplex.platform.engine.lora_runtime import LoRARuntime
from loraplex.platform.engine.maintenance import MaintenanceQueue
from loraplex.platform.engine.output_processor import OutputProcessor
from loraplex.platform.engine.outputs import RequestOutput
from loraplex.platform.engine.policy import FairSharePolicy
from loraplex.platform.engine.request_book import RequestBook
from loraplex.platform.engine.request_factory import RequestFactory
from loraplex.platform.engine.sampler import Sampler
from loraplex.platform.engine.sampling_params import SamplingParams
from loraplex.platform.engine.scheduler_output import SchedulerOutput
from loraplex.platform.engine.sequence import Request, Sequence, tenant_cache_salt
from loraplex.platform.engine.speculative import NgramProposer, Proposer, SpeculativeConfig, Speculator
from loraplex.platform.engine.stats import EngineStats
from loraplex.platform.engine.structured import GrammarCompiler, GrammarMasker, StepMasks
from loraplex.platform.model.arch import ModelArch
from loraplex.platform.model.source import model_display_name
from loraplex.storage.kv.sliced import SlicedJob

logger = logging.getLogger(__name__)


class LLMEngine:
    """Owns tokenizer, model runner, scheduler, KV blocks and sampler."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts = assemble(config)
        self.model_dir = parts.model_dir
        self.quantization = parts.quantization
        self.tokenizer = parts.tokenizer
        self.model, self.arch, self.hf_config = parts.model, parts.arch, parts.hf_config
        self.info = parts.info
        self.limits = EngineLimits(
            model_name=model_display_name(config.model),
            max_model_len=self.info.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_logprobs=config.max_logprobs,
            vocab_size=self.arch.vocab_size,
            enable_lora=config.enable_lora,
            max_lora_rank=config.max_lora_rank,
            dtype=self.info.dtype,
            block_size=config.block_size,
            eos_token_ids=tuple(self.info.eos_token_ids),
        )
        """What this engine accepts (fixed while it runs): requests are checked against it."""
        self.runner = parts.runner
        self.kv = parts.kv
        self.lora_runtime = parts.lora
        self.preemption = parts.preemption
        self.scheduler = parts.scheduler
        self.book = RequestBook(self.scheduler, self.check_integrity)
        """The unfinished requests, their deadlines and per-tenant counters; how each one ends."""
        self.requests = self.book.requests
        self.usage = self.book.usage
        self.rejections = self.book.rejections
        self.maintenance = MaintenanceQueue()
        """Purges and resets in progress, run in slices between steps (``run_maintenance``)."""
        self.kv_events = KVEventStream.start(config.kv_events, self.kv, config.block_size)
        """The KV events published to routers (``kv_events_config``); None when off."""
        self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size, self.info.eos_token_ids)
        """Compiled output constraints (``structured_outputs``), an LRU shared by every request."""
        self._masker: GrammarMasker | None = None  # made on the first constrained request
        self.factory = RequestFactory(
            self.tokenizer, self.limits, self.kv.block_manager, self.grammars, self.lora_runtime
        )
        """Validates what callers send into requests; makes their sequences."""
        self.outputs = OutputProcessor(
            self.scheduler,
            Sampler(torch.Generator().manual_seed(config.seed)),
            self.info,
            self.usage,
            self.factory.new_sequence,
            self.book.fail,
            self.book.retire,
        )
        spec = config.speculative
        self.speculator = None if spec is None else Speculator(spec, self._proposer(spec, parts.arch))
        """Speculative decoding (``speculative_config``): drafts in the scheduler, verification in
        the output processor; None when off."""
        self.scheduler.speculator = self.outputs.speculator = self.speculator
        self.scheduler.spec_max_len = self.info.max_model_len
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_batched_tokens = 0  # tokens run through the model (prefill, recompute and decode)
        self.stats: EngineStats = self._freeze_stats()
        """The state after the last step, published by one reference swap (any thread may read it)."""
        logger.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d tokens, max_model_len %d, %s, quantization %s",
            self.model_dir.name,
            self.info.device,
            self.info.dtype,
            self.info.num_kv_blocks,
            config.block_size,
            self.info.max_model_len,
            parts.backends,
            self.quantization,
        )

    def _proposer(self, spec: SpeculativeConfig, arch: ModelArch) -> Proposer:
        """The drafts' source: prompt lookup, or a draft model loaded beside the target."""
        if spec.method == "draft_model":
            return load_draft_proposer(spec, self.config, self.info, arch)
        return NgramProposer(spec)

    @property
    def sampler(self) -> Sampler:
        return self.outputs.sampler

    # -- requests ----------------------------------------------------------------
    def next_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of ``prompt`` (with the model's special tokens, e.g. BOS)."""
        return self.factory.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        tenant_id: str | None = None,
        tenant_weight: float = 1.0,
        timeout_s: float | None = None,
    ) -> Request:
        """Validate and queue a request.

        ``tenant_id`` and ``tenant_weight`` place it under fair scheduling (its tenant's share);
        ``timeout_s`` is its deadline from now: past it, the request ends with a ``DEADLINE``
        ``RequestError`` and frees its blocks, whether it waited or ran.

        Everything the request carries is checked here, against the model and the
        engine's limits, so no step can later fail because of it: bad values raise
        ``InvalidParameterError`` (naming the parameter), a request that could never be
        admitted raises ``RequestTooLargeError``, an adapter that cannot be served
        ``AdapterUnavailableError``. Nothing is queued when it raises.
        """
        if request_id in self.requests:
            raise InvalidParameterError(f"request_id {request_id!r} is already in use", param="request_id")
        req = self.factory.make(
            request_id, prompt, params, lora_request, priority, tenant_id, tenant_weight, timeout_s
        )
        if req.grammar is not None and self._masker is None:
            self._masker = GrammarMasker(self.grammars.mask_words)
        self.book.open(req, timeout_s)
        return req

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free everything it holds (unknown ids are ignored)."""
        req = self.requests.get(request_id)
        if req is not None:
            self.book.abort(req)

    # -- the prefix cache -------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block in every tier (vLLM's ``reset_prefix_cache``); True if done.

        Only while no request is unfinished (False otherwise, and nothing changes): a
        running sequence's blocks are in its table, a waiting one may hold a promotion.
        Device blocks lose their keys (they are reused without a demotion), host slots
        are freed and zeroed, disk records are dropped and their slot files erased, so a
        restart on the same ``disk_kv_path`` finds none. Counters stay cumulative. For
        weights changed in place, or to take derived data of deleted tenants and adapters
        off the disk at once (their blocks are unreachable, but would otherwise stay until
        reused).
        """
        job = self.start_reset_prefix_cache()
        if job is None:
            return False
        self.maintenance.remove(job)
        job.finish()
        return True

    def start_reset_prefix_cache(self) -> SlicedJob[tuple[int, int, int]] | None:
        """``reset_prefix_cache`` as a job the caller runs between steps (``run_maintenance``),
        its disk part in bounded slices; None (nothing changes) while requests are unfinished."""
        if self.has_unfinished_requests():
            logger.warning(
                "reset_prefix_cache refused: %d requests are unfinished; retry when the engine is idle",
                self.scheduler.num_unfinished,
            )
            return None
        self.scheduler.drain()  # promotions of aborted sequences land first, then go with the rest
        job = SlicedJob("reset the prefix cache", self.kv.reset_steps())
        self.maintenance.add(job)
        return job

    def purge_tenant(self, tenant_id: str) -> tuple[int, int, int]:
        """Forget tenant ``tenant_id``'s cached KV on every tier and cache none of it again (a
        deleted tenant); (device, host, disk) blocks forgotten.

        No one could hit those blocks anyway (keys bind the tenant salt, and a tenant created
        again gets another id), but the disk records are data derived from the tenant's
        prompts, at rest: they are erased now, with the records its promoted blocks left in
        free slot files. Runs while requests run (on the engine thread, between steps): its
        blocks in use keep their keys until freed, then are reused without a demotion.
        """
        job = self.start_purge_tenant(tenant_id)
        self.maintenance.remove(job)
        return job.finish()

    def start_purge_tenant(self, tenant_id: str) -> SlicedJob[tuple[int, int, int]]:
        """``purge_tenant`` as a job the caller runs between steps (``run_maintenance``), in
        bounded slices: on a disk tier of 100,000 blocks a purge touches as many files. From
        its first slice on, none of the tenant's blocks is cached again."""
        if isinstance(self.scheduler.policy, FairSharePolicy):
            self.scheduler.policy.forget(tenant_id)
        job = SlicedJob(f"purge tenant {tenant_id}", self.kv.purge_steps(tenant_cache_salt(tenant_id)))
        self.maintenance.add(job)
        return job

    def run_maintenance(self, budget_s: float) -> list[SlicedJob[Any]]:
        """Run the queued maintenance jobs (purges, resets) for about ``budget_s`` (at least one
        piece of the first); the jobs that ended: finished, or failed with ``job.error``."""
        return self.maintenance.run(budget_s)

    # -- adapters -------------------------------------------------------------------
    def _lora(self) -> LoRARuntime:
        if self.lora_runtime is None:
            raise AdapterUnavailableError("LoRA is disabled: build the engine with enable_lora=True")
        return self.lora_runtime

    def add_lora(
        self, lora_request: LoRARequest, owner: str | None = None, served_name: str | None = None
    ) -> None:
        """Validate and register an adapter (it loads into a slot when first used); ``served_name``:
        what clients call it, when not ``lora_request.name``."""
        self._lora().add_lora(lora_request, owner=owner, served_name=served_name)

    def stage_lora(self, lora_request: LoRARequest) -> StagedAdapter:
        """The slow half of ``add_lora``: validate the files into the adapter store. Safe on any
        thread (it changes nothing the engine serves); ``register_lora`` follows on the engine's."""
        return self._lora().stage_lora(lora_request)

    def register_lora(
        self,
        lora_request: LoRARequest,
        staged: StagedAdapter,
        owner: str | None = None,
        served_name: str | None = None,
    ) -> None:
        """The fast half of ``add_lora``: register a staged adapter (the engine's thread)."""
        self._lora().register_lora(lora_request, staged, owner=owner, served_name=served_name)

    def discard_staged_lora(self, staged: StagedAdapter) -> None:
        """Release a staged adapter that will not be registered (any thread)."""
        self._lora().discard_staged_lora(staged)

    def remove_lora(self, int_id: int) -> None:
        """Refuse new requests for the adapter; running ones finish with its old weights."""
        self._lora().remove_lora(int_id)

    def list_loras(self) -> list[int]:
        return list(self._lora().list_loras())

    def lora_tiers(self) -> dict[int, str]:
        """Where each registered adapter is now (``device``, ``host``, ``disk``); empty without LoRA."""
        return {} if self.lora_runtime is None else self.lora_runtime.lora_tiers()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the step ----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward; return the state of every request that progressed.

        A failure while planning a request fails that request; one while running the step
        fails the requests in it (their outputs carry ``error``); the engine goes on.
        ``step`` raises only when the engine itself cannot go on (``EngineDeadError``).
        """
        expired = self.book.expire()
        if not self.has_unfinished_requests():
            self.publish_stats()
            return expired
        started = time.perf_counter()
        try:
            out = self.scheduler.schedule()
        except Exception as exc:
            # Planning failed outside any one sequence's admission: which requests it concerns
            # is unknown, so every unfinished one fails; new ones are served.
            return expired + self._fail_all(exc)
        outputs = expired + self.book.take_rejected(out)
        if not out.is_empty:
            outputs += self._run(out)
            if self.speculator is not None:  # the step's cost per row, for the drafts' policy
                self.speculator.observe_step(out, time.perf_counter() - started)
        self.publish_stats()
        return outputs

    def _run(self, out: SchedulerOutput) -> list[RequestOutput]:
        self.num_steps += 1
        self.num_batched_tokens += out.num_batched_tokens
        masks: StepMasks | None = None
        try:
            lora_slots = self.lora_runtime.step_slots(out) if self.lora_runtime is not None else None
            # The grammar masks are computed on the masker's thread while the forward runs.
            masks = self._start_masks(out)
            started = time.perf_counter()
            logits, sample_idx = self.runner.execute(out, lora_slots, self.lora_runtime)
            self.preemption.observe_step(out.num_batched_tokens, time.perf_counter() - started)
            self.scheduler.update_from_output(out)
            return self.outputs.process(out, logits, sample_idx, masks)
        except Exception as exc:
            if masks is not None:
                masks.future.exception()  # the worker is done with the states before they go
            return self._fail_step(out, exc)

    def _start_masks(self, out: SchedulerOutput) -> StepMasks | None:
        if self._masker is None:
            return None
        states = {
            i: item.seq.grammar
            for i, item in enumerate(out.scheduled)
            if item.completes and item.seq.grammar is not None
        }
        return self._masker.start(states)

    @property
    def grammar_mask_times(self) -> tuple[int, float, float, float]:
        """Guided decoding's cost so far: (masks computed, seconds computing them on the worker,
        seconds the engine waited for them, seconds applying them)."""
        if self._masker is None:
            return (0, 0.0, 0.0, 0.0)
        t = self._masker.times
        return (t.masks, t.compute_s, t.wait_s, t.apply_s)

    def publish_stats(self) -> None:
        """Publish what the step (or the commands run between steps) changed: the KV events, as one
        batch, then the counters frozen into a new ``EngineStats`` (the engine's thread)."""
        if self.kv_events is not None:
            self.kv_events.flush()
        self.stats = self._freeze_stats()

    def _freeze_stats(self) -> EngineStats:
        """Freeze the counters into one ``EngineStats`` (on the engine's thread)."""
        scheduler = self.scheduler
        policy = scheduler.policy
        kv = self.kv
        return EngineStats(
            step=self.num_steps,
            timestamp=time.time(),
            num_waiting=len(scheduler.waiting),
            num_running=len(scheduler.running),
            num_swapped=sum(seq.swapped is not None for seq in scheduler.waiting),
            num_promotions_in_flight=scheduler.num_promotions_in_flight,
            num_preemptions=scheduler.num_preemptions,
            num_batched_tokens=self.num_batched_tokens,
            kv=kv.block_counts(),
            prefix_cache=kv.prefix_cache_stats(),
            tiers=tuple(kv.tier_metrics()),
            adapters=self.lora_runtime.adapter_manager.stats() if self.lora_runtime is not None else None,
            tenants=self.usage.snapshot(),
            virtual_counters=policy.snapshot() if isinstance(policy, FairSharePolicy) else {},
            tenant_weights=MappingProxyType(dict(policy.weights))
            if isinstance(policy, FairSharePolicy)
            else {},
            num_maintenance_jobs=len(self.maintenance),
            num_maintenance_slices=self.maintenance.num_slices,
            max_maintenance_slice_s=self.maintenance.max_slice_s,
            rejections=self.rejections.snapshot(),
            running_adapters=_adapter_names(scheduler.running),
            waiting_adapters=_adapter_names(scheduler.waiting),
            kv_events=self.kv_events.counters if self.kv_events is not None else None,
            spec_decode=self.speculator.counters.snapshot() if self.speculator is not None else None,
        )

    def _fail_step(self, out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """Abort the requests of a step that raised; keep serving everyone else."""
        reqs = {item.seq.request.request_id: item.seq.request for item in out.scheduled}
        logger.exception("engine step %d failed; failing its requests %s", self.num_steps, sorted(reqs))
        error = RequestError(ErrorKind.ENGINE_FAILURE, f"internal error while running this request: {exc}")
        return self.book.fail_checked(reqs.values(), error, exc)

    def _fail_all(self, exc: Exception) -> list[RequestOutput]:
        logger.exception("planning step %d failed; failing every unfinished request", self.num_steps + 1)
        message = f"internal error while scheduling this request: {exc!r}"
        error = RequestError(ErrorKind.ENGINE_FAILURE, message)
        outputs = self.book.fail_checked(list(self.requests.values()), error, exc)
        self.publish_stats()
        return outputs

    def shutdown(self) -> None:
        """Persist cached KV to the disk tier and stop its workers; the engine serves no more after it.

        Cached device and host blocks are written to disk (up to its cap) and every write in
        flight completes, so a later engine on the same ``disk_kv_path`` finds them again.
        """
        if self.kv_events is not None:
            self.kv_events.close()  # what persist moves below is not news to a router: it goes too
            self.kv_events = None
        if self.kv.tiers is not None:
            # Reads in flight land first (their blocks are cached like the rest).
            self.scheduler.drain()
        # What the accelerator pool still caches would be lost with the process: copied
        # down (host, then disk) so a restarted engine on the same path finds it.
        self.kv.persist()
        if self._masker is not None:
            self._masker.close()
        if self.lora_runtime is not None:
            # Its store holds copies of tenants' adapters ($TMPDIR/loraplex-adapters-*): removed.
            self.lora_runtime.adapter_manager.close()

    # -- invariants ----------------------------------------------------------------
    def check_integrity(self) -> None:
        """KV blocks conserved, ref counts consistent, one location per cached block across the
        tiers (``TieredKV.check_integrity``); and adapter slots, with LoRA."""
        self.kv.check_integrity()
        live = {s.seq_id for s in self.scheduler.running} | {s.seq_id for s in self.scheduler.waiting}
        for seq_id in self.kv.block_manager.seq_ids():
            if seq_id not in live:
                raise AssertionError(f"seq {seq_id} holds KV blocks but is neither running nor waiting")
        if self.lora_runtime is not None:
            self.lora_runtime.check_integrity(self.scheduler.running)


def _adapter_names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The display names of the adapters ``seqs`` run on, each once, in order."""
    names = {seq.request.adapter.display_name: None for seq in seqs if seq.request.adapter is not None}
    return tuple(names)
