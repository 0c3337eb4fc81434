"""Glue between the scheduler, the adapter manager and the model's LoRA hook.

Per step:
- admission (``admit``, then ``load``): a waiting sequence with an adapter is admitted only
  once it holds a pin on the adapter (resident: its pages in the device page pool);
  otherwise its weights are prefetched from disk in the background and the sequence waits
  without blocking others. An adapter in host memory is paged in (``load``) after the
  sequence's KV is allocated, into blocks still free (evicting unpinned adapters, least
  recently used first), at most ``lora_memory`` of the pool;
- execution (``step_slots``): each scheduled sequence contributes its adapter's slot
  (resident handle) to the per-token slot list that goes into the step's
  ``ForwardBatch``; the runtime is the batch's ``LoRAApplier``: per projection group it
  turns the slots into page passes (``_StepPages``) and the backend adds every
  adapter's delta, whatever its rank, in one ``apply_paged`` call;
- release: finishing, aborting or preempting a sequence unpins its slot.

Who holds which slot is recorded once, in the adapter manager's slot table (a pin per
sequence, keyed ``seq-<seq_id>``); the runtime asks it rather than keeping a copy.

No starvation: once an adapter has been blocked (no room: the pages or slots it needs
are all pinned) for ``drain_after_steps`` steps, one *draining* adapter is chosen (fewest
pins) and no new sequence is admitted onto it. Its running sequences finish in bounded
time (``max_tokens``), it unpins and becomes evictable; if that is not room enough (pages
are memory: a rank-64 adapter may need several small ones' pages), the next one drains,
and so on, until the blocked adapter fits: LoRAX's adapter cycling, driven by demand
rather than a timer.

Memory policy between adapters and the KV cache: one pool (``storage/kv/kv_arena.py``),
KV first. Adapter pages borrow free blocks from the pool's top; an adapter never preempts
a running sequence or takes a block a sequence holds, and before a sequence is preempted
or refused for KV, the adapters no running sequence uses give their blocks back
(``give_back_memory``). KV pressure never evicts an adapter a running sequence uses.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from loraplex.adapters import (
    AdapterError,
    AdapterIdentity,
    AdapterManager,
    AdapterManagerConfig,
    AdapterNotFoundError,
    AdapterRemovedError,
    AdapterValidationError,
    BaseModelSpec,
    LoRARequest,
    NoFreeSlotError,
    StagedAdapter,
)
from loraplex.adapters.page_arena import PageArena
from loraplex.adapters.page_table import PageTable
from loraplex.kernels.cpu.lora import BoundSite, PackedWeights
from loraplex.kernels.metadata import LoRAMetadata
from loraplex.kernels.registry import select_lora_backend
from loraplex.kernels.step_cache import IdentityCache
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.errors import AdapterUnavailableError, ErrorKind, RequestError
from loraplex.platform.engine.scheduler import AdmitDecision, SchedulerOutput
from loraplex.platform.engine.sequence import SeqStatus, Sequence
from loraplex.platform.model.forward_batch import LoRASites
from loraplex.platform.model.llama import LORA_GROUPS

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


def public_name(lora: LoRARequest) -> str:
    """How a client-facing message names ``lora``: its name without the version and row id a gateway
    appends to make engine names unique (``owner/name@version#id`` -> ``owner/name``)."""
    return lora.name.split("@", 1)[0]


def public_reason(exc: AdapterError) -> str:
    """Why an adapter cannot be served, in words that name no internal id, path or file: the
    validation rule that failed, or what happened to it. The full error goes to the server's log."""
    if isinstance(exc, AdapterValidationError):
        return f"its files failed the check {exc.reason!r}"
    if isinstance(exc, AdapterRemovedError):
        return "it was removed"
    if isinstance(exc, AdapterNotFoundError):
        return "it is not registered"
    return "it could not be loaded"


class LoRARuntime:
    """Owns the ``AdapterManager`` on the engine's device and serves the LoRA hook."""

    blocked_expiry_steps = 64
    """A blocked adapter not refused for this many steps is forgotten (its requests were
    aborted or finished another way), so its draining adapters admit again."""

    lookahead_adapters = 32
    """Distinct adapters of the next waiting requests read ahead from the store each step
    (within half the host cache), so a request rarely waits for its adapter's read."""

    drain_after_steps = 8
    """Grace before draining a slot for a blocked adapter: short waits cost nothing,
    while draining at once would stall requests for resident adapters."""

    def __init__(
        self,
        config: EngineConfig,
        hf_config: PretrainedConfig,
        device: torch.device,
        dtype: torch.dtype,
        arena: PageArena | None = None,
    ) -> None:
        """``arena``: where adapter pages live (the engine's KV pool); None: memory of their own."""
        self.block_size = config.block_size
        self.backend = select_lora_backend(config.lora_backend, device)
        self.adapter_manager = AdapterManager(
            BaseModelSpec.from_hf_config(hf_config),
            AdapterManagerConfig(
                max_loras=config.max_loras,
                max_lora_rank=config.max_lora_rank,
                max_cpu_loras=config.cpu_lora_capacity,
                cpu_lora_memory=config.cpu_lora_memory_bytes,
                lora_page_rank=config.lora_page_rank,
                lora_memory=config.lora_memory_bytes,
            ),
            device=device,
            dtype=dtype,
            weight_layout=self.backend.weight_layout(dtype, device),
            arena=arena,
        )
        # Blocked adapter id -> (step first blocked, step last refused): an entry not refused
        # for blocked_expiry_steps (its requests ended another way) is dropped in step_slots.
        self._blocked: dict[int, tuple[int, int]] = {}
        self._draining: set[int] = set()  # adapter ids no new sequence is admitted onto
        self._removed: set[int] = set()  # ids removed at run time, for clear errors
        # (int_id, path) of a request naming a registered id from another path -> that path's version.
        self._same_content: dict[tuple[int, str], str] = {}
        self._step = 0
        self._step_pages: IdentityCache[LoRAMetadata, _StepPages] = IdentityCache(max_entries=4)
        self._page_tables: dict[int, PageTable] = {}
        self._pool_generation = self.adapter_manager.pool_generation
        # (layer, group) -> the checked pool weights there (c_sites): the pool tensors stay
        # the same until it reallocates (a new generation clears this).
        self._site_weights: dict[tuple[int, str], PackedWeights] = {}

    # -- registry -------------------------------------------------------------------
    def add_lora(self, lora: LoRARequest, owner: str | None = None, served_name: str | None = None) -> None:
        """Validate and register ``lora`` (no-op if this exact adapter is registered)."""
        self.register_lora(lora, self.stage_lora(lora), owner, served_name)

    def stage_lora(self, lora: LoRARequest) -> StagedAdapter:
        """Validate ``lora``'s files into the adapter store: slow, safe on any thread, changes
        nothing the engine serves; ``register_lora`` (on the engine thread) follows."""
        return self.adapter_manager.stage_lora(lora)

    def register_lora(
        self,
        lora: LoRARequest,
        staged: StagedAdapter,
        owner: str | None = None,
        served_name: str | None = None,
    ) -> None:
        """Register a staged adapter (fast; the engine thread, between steps)."""
        self.adapter_manager.register_lora(lora, staged, owner=owner, served_name=served_name)
        self._removed.discard(lora.int_id)

    def discard_staged_lora(self, staged: StagedAdapter) -> None:
        """Release a staged adapter that will not be registered."""
        self.adapter_manager.discard_staged_lora(staged)

    def remove_lora(self, int_id: int) -> None:
        """Refuse new requests for the adapter; running ones finish on its old weights."""
        self.adapter_manager.remove_lora(int_id)
        self._blocked.pop(int_id, None)
        self._removed.add(int_id)
        self._same_content = {k: v for k, v in self._same_content.items() if k[0] != int_id}

    def list_loras(self) -> list[int]:
        return [info.adapter_id for info in self.adapter_manager.list_adapters()]

    def lora_tiers(self) -> dict[int, str]:
        """Each registered adapter's fastest tier now: ``device`` (a slot), ``host`` or ``disk``."""
        return {info.adapter_id: info.tier for info in self.adapter_manager.list_adapters()}

    def resolve(self, lora: LoRARequest, owner: str | None = None) -> AdapterIdentity:
        """Make sure ``lora`` is registered (first use loads it, as in vLLM); its identity.

        Raises ``AdapterUnavailableError`` when its files cannot be served, or when its id and
        name are registered from another path with other content (serving the registered
        weights for it would silently answer with the wrong adapter).
        """
        if not isinstance(lora, LoRARequest):
            raise AdapterUnavailableError(
                f"lora_request must be a LoRARequest, got {type(lora).__name__}", param="lora_request"
            )
        known = {info.adapter_id: info for info in self.adapter_manager.list_adapters()}
        info = known.get(lora.int_id)
        if info is None:
            try:
                info = self.adapter_manager.add_lora(lora, owner=owner)
            except AdapterError as exc:
                raise AdapterUnavailableError(f"adapter {lora.name!r}: {exc}", param="model") from exc
            self._removed.discard(lora.int_id)
        elif info.name != lora.name:
            raise AdapterUnavailableError(
                f"lora_request int_id {lora.int_id} is registered as {info.name!r}, not {lora.name!r}",
                param="lora_request",
            )
        elif info.source != lora.path:
            self._check_same_content(lora, info.source, info.version)
        return info.identity

    def _check_same_content(self, lora: LoRARequest, registered_path: str, version: str) -> None:
        """Refuse ``lora`` if its path holds other weights than the ones registered under its id."""
        key = (lora.int_id, lora.path)
        found = self._same_content.get(key)
        if found is None:
            try:
                staged = self.adapter_manager.stage_lora(lora)
            except AdapterError as exc:
                raise AdapterUnavailableError(f"adapter {lora.name!r}: {exc}", param="model") from exc
            found = staged.parsed.version
            self.adapter_manager.discard_staged_lora(staged)
            self._same_content[key] = found
        if found != version:
            raise AdapterUnavailableError(
                f"lora_request {lora.name!r} (int_id {lora.int_id}) names {lora.path}, but that id is "
                f"registered from {registered_path} with other weights (version {version[:12]}, the new "
                f"path holds {found[:12]}); remove_lora({lora.int_id}) first to serve the new files, or "
                "give them another int_id",
                param="lora_request",
            )

    # -- scheduler hooks --------------------------------------------------------------
    @staticmethod
    def _key(seq: Sequence) -> str:
        return f"seq-{seq.seq_id}"

    def admit(self, seq: Sequence) -> AdmitDecision:
        lora = seq.request.lora
        if lora is None:
            return AdmitDecision.OK
        aid = lora.int_id
        try:
            if aid in self._draining and self._blocked and aid not in self._blocked:
                return AdmitDecision.WAIT  # let the draining adapter empty for a blocked one
            if self.adapter_manager.is_resident(aid):
                return self._pin(seq)
            if self.adapter_manager.can_acquire(aid):
                return AdmitDecision.LOAD  # paged in once the sequence's KV is allocated
            # Not read here: the scheduler's lookahead starts the reads for the waiting
            # sequences in admission order, bounded by the host cache (reading for every
            # sequence admission reaches would push earlier reads out before they are used).
            self.adapter_manager.prefetch(aid, start=False)
        except AdapterError as exc:
            if aid in self._removed:
                message = f"adapter {public_name(lora)!r} was removed while this request waited"
            else:
                message = f"adapter {public_name(lora)!r} cannot be served: {public_reason(exc)}"
            seq.request.error = RequestError(ErrorKind.ADAPTER_UNAVAILABLE, message)
            self._log_rejected(seq, lora, exc)
            return AdmitDecision.REJECT
        return self._blocked_wait(aid)

    def _pin(self, seq: Sequence, keep_free_blocks: int = 0) -> AdmitDecision:
        assert seq.request.lora is not None
        aid = seq.request.lora.int_id
        self.adapter_manager.acquire(aid, self._key(seq), keep_free_blocks=keep_free_blocks)
        if self._blocked.pop(aid, None) is not None:
            # The blocked adapter got its room; drain again only for another one.
            self._draining.clear()
        return AdmitDecision.OK

    def load(self, seq: Sequence, keep_free_blocks: int) -> AdmitDecision:
        """After ``admit`` said LOAD: page the sequence's adapter in and pin it, leaving
        ``keep_free_blocks`` of the pool free for the sequence's KV (OK); or WAIT (no room
        now); or REJECT (the adapter and that KV never fit the pool together)."""
        lora = seq.request.lora
        assert lora is not None
        try:
            return self._pin(seq, keep_free_blocks)
        except NoFreeSlotError:
            pass
        except AdapterError as exc:
            message = f"adapter {public_name(lora)!r} cannot be served: {public_reason(exc)}"
            seq.request.error = RequestError(ErrorKind.ADAPTER_UNAVAILABLE, message)
            self._log_rejected(seq, lora, exc)
            return AdmitDecision.REJECT
        kv_blocks = -(-seq.num_tokens // self.block_size)
        if not self.adapter_manager.could_ever_fit_beside(lora.int_id, kv_blocks):
            seq.request.error = RequestError(
                ErrorKind.INVALID,
                f"adapter {public_name(lora)!r} and this request's KV do not fit the "
                "device pool together; shorten the prompt or raise kv_cache_memory",
            )
            return AdmitDecision.REJECT
        return self._blocked_wait(lora.int_id)

    @staticmethod
    def _log_rejected(seq: Sequence, lora: LoRARequest, exc: AdapterError) -> None:
        # The whole story for the operator; the client's message names no id or path.
        request_id = seq.request.request_id
        logger.warning("request %s rejected: adapter %r (id %d): %s", request_id, lora.name, lora.int_id, exc)

    def give_back_memory(self, num_blocks: int) -> int:
        """The scheduler's memory hook: ``num_blocks`` pool blocks back to the KV cache (see
        ``AdapterManager.give_back_memory``); how many came back."""
        return self.adapter_manager.give_back_memory(num_blocks)

    def _blocked_wait(self, aid: int) -> AdmitDecision:
        """``aid`` has no room now: remember it, and drain an adapter if it waited long enough."""
        since, _ = self._blocked.get(aid, (self._step, self._step))
        self._blocked[aid] = (since, self._step)
        if self._step - since >= self.drain_after_steps:
            pins: dict[int, int] = {}
            for adapter_id in self.adapter_manager.pins().values():
                pins[adapter_id] = pins.get(adapter_id, 0) + 1
            if not any(pins.get(a, 0) for a in self._draining):
                # Nothing is draining, or what drained has emptied (it is evictable now) and
                # there is still no room: drain one more, the one with the fewest running
                # users (it empties soonest). Memory may need several adapters' pages.
                candidates = {a: n for a, n in pins.items() if a != aid and a not in self._draining}
                if candidates:
                    self._draining.add(min(candidates, key=lambda a: (candidates[a], a)))
        return AdmitDecision.WAIT

    def lookahead(self, waiting: list[Sequence]) -> None:
        """After admission: read ahead the adapters of the next waiting sequences (in the order
        admission will try them) while this step runs; queued reads nobody needs are dropped."""
        ids: list[int] = []
        seen: set[int] = set()
        for seq in waiting:
            lora = seq.request.lora
            if lora is None or lora.int_id in seen or seq.status is not SeqStatus.WAITING:
                continue
            seen.add(lora.int_id)
            ids.append(lora.int_id)
            if len(ids) >= self.lookahead_adapters:
                break
        self.adapter_manager.prefetch_ahead(ids, self.lookahead_adapters)

    idle_wait_s = 0.05
    """How long an idle step waits for an adapter read before returning (empty) to its caller."""

    def wait_for_a_read(self) -> bool:
        """The step would be empty: block (up to ``idle_wait_s``) until a background adapter
        read finishes; True if one did."""
        return self.adapter_manager.wait_for_a_read(self.idle_wait_s)

    def release(self, seq: Sequence) -> None:
        self.adapter_manager.release(self._key(seq))

    def on_fork(self, parent: Sequence, child: Sequence) -> None:
        """A forked sibling uses its parent's (resident, pinned) adapter slot too."""
        lora = parent.request.lora
        if lora is not None and self.adapter_manager.pinned_slot(self._key(parent)) is not None:
            self.adapter_manager.acquire(lora.int_id, self._key(child))

    @property
    def num_pins(self) -> int:
        """Slot pins held by running sequences (0 when nothing runs on an adapter)."""
        return sum(self.adapter_manager.pins_by_slot().values())

    # -- execution --------------------------------------------------------------------
    def step_slots(self, out: SchedulerOutput) -> list[int] | None:
        """Each scheduled sequence's adapter slot (-1 = base model); None if no adapter runs."""
        self._step += 1
        # A blocked adapter is refused only when admission reaches its request (not while the
        # step's seats are full), so allow long gaps; past this one its requests ended otherwise.
        stale = [a for a, (_, last) in self._blocked.items() if self._step - last > self.blocked_expiry_steps]
        for adapter_id in stale:
            del self._blocked[adapter_id]
        if not self._blocked:
            self._draining.clear()
        slots = [-1 if item.seq.request.lora is None else self._pinned(item.seq) for item in out.scheduled]
        if all(s < 0 for s in slots):
            return None
        # The pages of every adapter this step uses, read once (the kernels read them per layer).
        self._page_tables = self.adapter_manager.page_tables()
        generation = self.adapter_manager.pool_generation
        if generation != self._pool_generation:
            self._pool_generation = generation
            self._site_weights.clear()
            forget = getattr(self.backend, "forget_weights", None)
            if forget is not None:
                forget()  # cached views of the old pool tensors would keep them alive
        return slots

    def _pinned(self, seq: Sequence) -> int:
        slot = self.adapter_manager.pinned_slot(self._key(seq))
        if slot is None:
            raise AssertionError(f"seq {seq.seq_id} is scheduled on an adapter but holds no slot pin")
        return slot

    def apply(self, layer_idx: int, group: str, x: torch.Tensor, y: torch.Tensor, meta: LoRAMetadata) -> None:
        """``LoRAApplier``: add the LoRA deltas of ``group`` in layer ``layer_idx`` to ``y``."""
        passes = self._step_pages.get(meta, self._plan_pages).passes(group)
        if not passes:
            return
        a, b, scales, sizes = self.adapter_manager.get_buffers(layer_idx, group)  # type: ignore[arg-type]
        self.backend.apply_paged(y, x, a, b, scales, sizes, passes)

    def c_sites(self, meta: LoRAMetadata, num_layers: int) -> LoRASites | None:
        """The step's LoRA as prebound C kernel calls, per layer and group (``LoRABatch.c_sites``).

        Planned once per step: each group's page passes and token groups (shared by every
        layer), and each site's checked weights (cached until the page pool reallocates).
        None when the backend has no C kernel or cannot read a site's weights (the hook
        serves the step then, with the same result).
        """
        prebind = getattr(self.backend, "prebind_paged", None)
        if prebind is None:
            return None
        pages = self._step_pages.get(meta, self._plan_pages)
        sites: list[tuple[BoundSite | None, ...]] = []
        per_group = [(g, pages.passes(g)) for g in LORA_GROUPS]
        for layer in range(num_layers):
            row: list[BoundSite | None] = []
            for group, passes in per_group:
                if not passes:
                    row.append(None)
                    continue
                weights = self._site_weights.get((layer, group))
                if weights is None:
                    a, b, scales, sizes = self.adapter_manager.get_buffers(layer, group)  # type: ignore[arg-type]
                    weights = self.backend.packed_weights(a, b, scales, sizes)  # type: ignore[attr-defined]
                    if weights is None:
                        return None
                    self._site_weights[(layer, group)] = weights
                row.append(prebind(weights, passes))
            sites.append(tuple(row))
        return sites

    def _plan_pages(self, meta: LoRAMetadata) -> _StepPages:
        return _StepPages(meta, self._page_tables)

    def check_integrity(self, running: Iterable[Sequence] | None = None) -> None:
        """Adapter slots and pages consistent (``AdapterManager.check_integrity``); with
        ``running``: pins match the running sequences (each running sequence on an adapter
        holds one pin on that adapter's slot, nothing else holds a pin)."""
        self.adapter_manager.check_integrity()
        if running is None:
            return
        want = {self._key(seq): seq.request.lora.int_id for seq in running if seq.request.lora is not None}
        held = self.adapter_manager.pins()
        if set(held) != set(want):
            raise AssertionError(f"adapter pins {sorted(held)} != running sequences {sorted(want)}")
        for key, adapter_id in want.items():
            if held[key] != adapter_id:
                raise AssertionError(f"{key} pins adapter {held[key]}, runs on adapter {adapter_id}")


class _StepPages:
    """One step's page passes per projection group, derived from its slot metadata.

    ``passes(group)[i]`` maps each token to page ``i`` of its adapter's ``group`` pages
    (-1: the adapter has fewer pages there, does not target the group, or the token runs
    on the base model). Built per group on first use, from the segments (O(sequences)).
    """

    def __init__(self, meta: LoRAMetadata, page_tables: dict[int, PageTable]) -> None:
        self._starts = meta.seg_starts_cpu or tuple(meta.seg_starts.tolist())
        self._slots = meta.seg_slots_cpu or tuple(meta.seg_slots.tolist())
        self._device = meta.token_slots.device
        self._tables = page_tables
        self._passes: dict[str, tuple[LoRAMetadata, ...]] = {}

    def passes(self, group: str) -> tuple[LoRAMetadata, ...]:
        found = self._passes.get(group)
        if found is not None:
            return found
        pages = [self._tables[s].get(group, []) if s >= 0 else [] for s in self._slots]  # type: ignore[call-overload]
        depth = max((len(p) for p in pages), default=0)
        found = tuple(
            LoRAMetadata.from_segments(
                self._starts, [p[i] if len(p) > i else -1 for p in pages], self._device
            )
            for i in range(depth)
        )
        self._passes[group] = found
        return found
