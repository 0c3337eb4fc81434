"""``AdapterManager``: the registry and the three weight tiers, as the engine sees them.

Tiers (like LoRAX and vLLM)::

    device pages (lora_memory)  <-  host LRU (max_cpu_loras)  <-  disk store (all adapters)

A resident adapter has a *slot* (a handle: the index tokens carry) and pages in the page
pool (``page_pool.py``) for the rank rows of the groups it targets. How many adapters are
resident at once is bounded by the pool's memory (and by ``max_loras`` when set), not by
a fixed slot count.

Scheduler protocol, per step, for a request that wants adapter ``a``::

    if mgr.can_acquire(a):               # resident, or in host memory with a slot to spare
        slot = mgr.acquire(a, req_id)    # pins the slot for this request (idempotent per request)
    else:
        mgr.prefetch(a)                  # background disk -> host read; try again next step
    ...
    mgr.release(req_id)                  # when the request finishes, aborts or is preempted

A slot is pinned once per running request that uses it; only unpinned slots are
evicted, least recently used first, when a new adapter needs a slot (past ``max_loras``)
or pages (past ``lora_memory``). ``remove_lora`` refuses new requests at once,
while requests already pinned to the adapter's slot finish on its old weights; the
slot frees with its last ``release``.

Threading: every public method may be called from any thread (one re-entrant lock).
Disk reads for ``prefetch`` run on loader threads without that lock; their results
are collected by the next call from the engine, so a slow read never blocks requests
for other adapters. ``add_lora`` validates outside the lock for the same reason.

The manager is the lock over helpers that are not thread-safe on their own:
``Registration`` (``registration.py``: adding and removing adapters, the registry),
``DeviceResidency`` (``residency.py``: slots, page tables, eviction), ``HostAdapterCache``
(``host_cache.py``), ``Prefetcher`` (``prefetch.py``: background reads ahead of requests) and
``StoreReads`` (``store_reads.py``: the reads themselves); ``stats.py`` reads them all.
Here: acquiring and releasing slots for requests, the one path that crosses every tier.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from types import TracebackType

import torch

from loraplex.adapters.config import AdapterManagerConfig
from loraplex.adapters.errors import NoFreeSlotError
from loraplex.adapters.host_cache import HostAdapterCache
from loraplex.adapters.load_times import LoadTimes
from loraplex.adapters.page_arena import OwnedArena, PageArena
from loraplex.adapters.page_table import PageTable
from loraplex.adapters.peft_weights import AdapterWeights
from loraplex.adapters.prefetch import Prefetcher
from loraplex.adapters.registration import Registration
from loraplex.adapters.registry import AdapterEntry, AdapterInfo, AdapterRegistry
from loraplex.adapters.request import LoRARequest
from loraplex.adapters.residency import DeviceResidency, PagesNeeded
from loraplex.adapters.slot_buffers import SlotBuffers
from loraplex.adapters.spec import BaseModelSpec, GroupName
from loraplex.adapters.stats import AdapterStats, tier_stats
from loraplex.adapters.store import AdapterStore, StagedAdapter
from loraplex.adapters.store_reads import StoreReads
from loraplex.kernels.lora_layout import LOGICAL_LAYOUT, LoRAWeightLayout

__all__ = ["AdapterManager"]


class AdapterManager:
    """Registers validated adapters and moves their weights between disk, host and device slots."""

    def __init__(
        self,
        spec: BaseModelSpec,
        config: AdapterManagerConfig | None = None,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        weight_layout: LoRAWeightLayout = LOGICAL_LAYOUT,
        arena: PageArena | None = None,
    ) -> None:
        """``weight_layout``: how the device slots store adapters, the LoRA backend's
        ``weight_layout`` (the logical one by default). ``arena``: the memory the page pool
        lays its pages out in (an engine passes blocks of its KV pool); by default memory of
        its own, ``lora_memory`` bytes at most."""
        self.spec = spec
        self.config = config or AdapterManagerConfig()
        self.device = torch.device(device)
        self.dtype = dtype
        self._store = AdapterStore(
            self.config.store_dir, self.config.archive_limits, self.config.copy_directories
        )
        if self.config.store_dir is not None:
            self._store.open()  # leftovers of a crash
        self._host = HostAdapterCache(self.config.max_cpu_loras, self.config.cpu_lora_memory)
        self._reads = StoreReads(
            self._store, spec, self.config.max_lora_rank, dtype, self.device, self.config.num_loader_threads
        )
        if arena is None:
            arena = OwnedArena(spec.num_layers, self.config.lora_memory, self.device)
        self._residency = DeviceResidency(
            spec, self.config.max_loras, self.config.lora_page_rank, arena, self.device, dtype, weight_layout
        )
        self._slots = self._residency.slots
        self._pool = self._residency.pool
        self._registry = AdapterRegistry()
        self._registration = Registration(
            spec,
            self.config.max_lora_rank,
            dtype,
            self._store,
            self._registry,
            self._host,
            self._reads,
            self._residency,
        )
        self._prefetcher = Prefetcher(self._registry, self._slots, self._host, self._reads)
        self._load_times = LoadTimes()
        self._lock = threading.RLock()
        self._closed = False
        """close() ran: the store's folders are deleted (what check_integrity compares is gone)."""

    # -- registry ----------------------------------------------------------------------

    def add_lora(
        self, request: LoRARequest, owner: str | None = None, served_name: str | None = None
    ) -> AdapterInfo:
        """Validate the adapter at ``request.path`` and register it under ``request.int_id``.

        Raises ``AdapterValidationError`` (nothing registered, no files left behind) or
        ``AdapterExistsError`` if the id or ``(owner, name)`` is taken by other content.
        Adding the very same adapter again returns the existing entry.
        """
        return self.register_lora(request, self.stage_lora(request), owner, served_name)

    def stage_lora(self, request: LoRARequest) -> StagedAdapter:
        """The slow half of ``add_lora``: validate and store the files (any thread, no lock held).

        Changes nothing the scheduler sees; hand the result to ``register_lora`` (or ``discard_staged_lora``).
        """
        return self._registration.stage(request)

    def discard_staged_lora(self, staged: StagedAdapter) -> None:
        """Give up a ``stage`` result that will not be registered (its store folder is released)."""
        self._registration.discard(staged)

    def register_lora(
        self,
        request: LoRARequest,
        staged: StagedAdapter,
        owner: str | None = None,
        served_name: str | None = None,
    ) -> AdapterInfo:
        """The fast half of ``add_lora``: register validated files under ``request.int_id``
        (``served_name``: what clients call it, when not ``request.name``).

        Raises ``AdapterExistsError`` if the id or ``(owner, name)`` is taken by other content
        (``staged`` is released then); the very same adapter again returns the existing entry.
        """
        try:
            with self._lock:
                return self._registration.register(request, staged, owner, served_name)
        except BaseException:
            self._registration.discard(staged)
            raise

    def remove_lora(self, adapter_id: int) -> AdapterInfo:
        """Unregister ``adapter_id``: new acquires fail now; running requests finish on its old weights."""
        with self._lock:
            return self._registration.remove(adapter_id)

    def get_adapter(self, adapter_id: int) -> AdapterInfo:
        """The registered adapter ``adapter_id``; raises ``AdapterNotFoundError``/``AdapterRemovedError``."""
        with self._lock:
            return self._registration.info(self._registry.require(adapter_id))

    def find_adapter(self, name: str, owner: str | None = None) -> AdapterInfo | None:
        """The adapter ``owner`` registered as ``name``, or None."""
        with self._lock:
            entry = self._registry.find(name, owner)
            return None if entry is None else self._registration.info(entry)

    def list_adapters(self) -> list[AdapterInfo]:
        """Every registered adapter, by id."""
        with self._lock:
            return [self._registration.info(entry) for entry in self._registry.entries()]

    # -- scheduler -----------------------------------------------------------------------

    def is_resident(self, adapter_id: int) -> bool:
        """Whether ``adapter_id`` is loaded in a device slot (acquiring it costs no copy)."""
        with self._lock:
            return self._slots.slot_of(adapter_id) is not None

    def slot_of(self, adapter_id: int) -> int | None:
        """The device slot of ``adapter_id``, or None if it is not resident."""
        with self._lock:
            return self._slots.slot_of(adapter_id)

    @property
    def num_free_slots(self) -> int:
        """Free slots that exist now (evictable ones not counted; an uncapped table grows more)."""
        with self._lock:
            return self._slots.num_free

    def can_acquire(self, adapter_id: int) -> bool:
        """Whether ``acquire`` would succeed now without reading from disk.

        True if the adapter is resident, or in host memory while a slot is free or
        evictable. Raises ``AdapterNotFoundError``/``AdapterRemovedError`` for an
        adapter that is not registered, so the caller can fail the request.
        """
        with self._lock:
            self._prefetcher.collect()
            entry = self._registry.require(adapter_id)
            if self._slots.slot_of(adapter_id) is not None:
                return True
            weights = self._host.get(entry.identity.version)
            return weights is not None and self._residency.could_make_room(self._pages_needed(entry, weights))

    def could_ever_fit_beside(self, adapter_id: int, kv_blocks: int) -> bool:
        """Whether ``adapter_id``'s pages could fit the arena while ``kv_blocks`` of KV are in
        use, every other adapter evicted (False: a request that large never runs on it)."""
        with self._lock:
            entry = self._registry.require(adapter_id)
            weights = self._host.get(entry.identity.version)
            if weights is None:
                return True  # not known yet: the load will tell
            return self._residency.could_ever_fit_beside(self._pages_needed(entry, weights), kv_blocks)

    def prefetch(self, adapter_id: int, start: bool = True) -> bool:
        """Start reading ``adapter_id`` from disk into host memory; True if already there.

        A failed background read is raised here (once), e.g. ``changed_on_disk``.
        ``start=False`` only checks (and raises a failed read): ``prefetch_ahead`` reads.
        """
        with self._lock:
            return self._prefetcher.prefetch(adapter_id, start)

    def prefetch_ahead(self, adapter_ids: Iterable[int], max_adapters: int = 32) -> None:
        """Read ahead: the adapters of the next requests to admit, in that order.

        Takes the first ``max_adapters`` of ``adapter_ids`` that are not resident, within half
        the host cache (those already in host memory count: what is read ahead must not push
        out what was read ahead before it is used), starts background store reads for those
        not in host memory, and cancels reads still queued for any
        other adapter: a request that was admitted, aborted or overtaken no longer needs
        one, and a newcomer's read must not wait behind it. Unknown ids are skipped
        (admission reports them). Never raises for a failed read (``prefetch`` does).
        """
        with self._lock:
            self._prefetcher.ahead(adapter_ids, max_adapters)

    def wait_for_a_read(self, timeout: float) -> bool:
        """Block (without the manager lock) until a background store read in flight finishes,
        at most ``timeout`` seconds; True if one did, or if one had finished since the last
        look (it is moved to the host cache now, without waiting). Either way a True means
        news: a read that no call has collected yet (a caller may loop on it)."""
        with self._lock:
            if self._prefetcher.collect():
                # A read finished since the caller last looked (between its admission and
                # this call): that is the news; waiting for another would return empty-handed.
                return True
            pending = self._reads.pending()
        return StoreReads.wait_any(pending, timeout)

    def acquire(self, adapter_id: int, request_id: str, *, keep_free_blocks: int = 0) -> int:
        """Pin ``adapter_id``'s slot for ``request_id``, loading it first if needed; return the slot.

        Idempotent per request: a request that already holds the slot gets it again
        (also after the adapter was removed, so it can finish). Loads into the lowest
        free slot, else evicts the least recently used unpinned slot; reads from disk
        synchronously on a host miss (use ``prefetch`` to avoid that). Raises
        ``AdapterRemovedError``/``AdapterNotFoundError`` for an unregistered adapter and
        ``NoFreeSlotError`` when every slot is pinned. ``keep_free_blocks``: blocks of an
        arena that borrows from the KV pool that loading must leave free (the KV the request
        is about to take).
        """
        with self._lock:
            held = self._slots.slot_of_request(request_id)
            if held is not None:
                if self._slots.key_of(held) == adapter_id:
                    return held
                raise ValueError(
                    f"request {request_id!r} already holds slot {held} of adapter {self._slots.key_of(held)}"
                )
            entry = self._registry.require(adapter_id)
            slot_idx = self._slots.slot_of(adapter_id)
            if slot_idx is None:
                if not self._slots.can_place():
                    raise NoFreeSlotError(
                        f"adapter {adapter_id}: all {self._slots.num_slots} resident adapters are "
                        "pinned by running requests; retry when one finishes"
                    )
                started = time.perf_counter()
                weights = self._host_weights(entry)
                need = self._pages_needed(entry, weights)
                slot_idx = self._residency.load(adapter_id, weights, need, keep_free_blocks)
                self._load_times.observe(time.perf_counter() - started)
            self._slots.pin(slot_idx, request_id)
            return slot_idx

    def release(self, request_id: str) -> bool:
        """Drop ``request_id``'s pin (finish, abort, preemption); False if it held none."""
        with self._lock:
            unpinned = self._slots.unpin(request_id)
            if unpinned is None:
                return False
            if unpinned.freed:
                self._registration.finish_draining(unpinned.slot_idx)
            return True

    def pinned_slot(self, request_id: str) -> int | None:
        """The slot ``request_id`` holds a pin on, or None: the one record of who uses what."""
        with self._lock:
            return self._slots.slot_of_request(request_id)

    def pins_by_slot(self) -> dict[int, int]:
        """Pins held on each slot that has any (slot -> number of holders)."""
        with self._lock:
            counts = (self._slots.pin_count(i) for i in range(self._slots.num_slots))
            return {i: c for i, c in enumerate(counts) if c > 0}

    def pins(self) -> dict[str, int]:
        """Every pin holder (request id) and the adapter its pinned slot holds."""
        with self._lock:
            return self._slots.pinned_keys()

    def page_tables(self) -> dict[int, PageTable]:
        """Each resident (or draining) slot's pages per group: what a step's kernels read."""
        with self._lock:
            return self._residency.page_tables()

    def pages_of(self, adapter_id: int) -> PageTable | None:
        """The pages of resident ``adapter_id`` per group, or None if it is not resident."""
        with self._lock:
            return self._residency.pages_of(adapter_id)

    def give_back_memory(self, num_blocks: int) -> int:
        """Return arena blocks to the KV cache, evicting unpinned adapters (least recently
        used first) until ``num_blocks`` came back or nothing more can; how many came back.

        The engine calls this before it would preempt a sequence or refuse one for KV: the
        KV cache comes first, adapters no running request uses yield to it.
        """
        with self._lock:
            return self._residency.give_back_memory(num_blocks)

    @property
    def pool_generation(self) -> int:
        """Changes when a page pool reallocates (the buffers ``get_buffers`` gives are new)."""
        return self._pool.generation

    @property
    def page_rank(self) -> int:
        return self._pool.page_rank

    def stats(self) -> AdapterStats:
        """Where the adapters are now, and how often they moved (a snapshot, for ``EngineStats``)."""
        with self._lock:
            return tier_stats(
                self.config, self._registry, self._residency, self._host, self._reads, self._load_times
            )

    # -- model runner ----------------------------------------------------------------------

    def get_buffers(self, layer_idx: int, group: GroupName) -> SlotBuffers:
        """``(lora_a, lora_b, scales, slice_sizes)`` of ``group``'s pages in layer ``layer_idx``,
        in the weight layout (what the LoRA backend's ``apply`` reads; slots index pages)."""
        return self._pool.get(layer_idx, group)

    def get_logical_buffers(self, layer_idx: int, group: GroupName) -> SlotBuffers:
        """The same in the logical layout (a copy where the weight layout needs one)."""
        return self._pool.get_logical(layer_idx, group)

    @property
    def device_nbytes(self) -> int:
        """Device memory of the adapter page pools."""
        return self._pool.nbytes

    # -- invariants and lifetime -----------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError if slots, pins, tiers and the registry disagree."""
        with self._lock:
            self._slots.check_integrity()
            errors = self._registration.check(store_closed=self._closed)
            if errors:
                raise AssertionError("adapter manager inconsistent: " + "; ".join(errors))

    def close(self) -> None:
        """Stop loader threads and delete the store's folders."""
        with self._lock:
            executor = self._reads.detach_executor()
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        self._store.close()
        self._closed = True

    def __enter__(self) -> AdapterManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _pages_needed(self, entry: AdapterEntry, weights: AdapterWeights) -> PagesNeeded:
        return self._residency.pages_needed(entry.identity.version, weights)

    def _host_weights(self, entry: AdapterEntry) -> AdapterWeights:
        """The adapter's host weights, reading them from disk now on a miss (caller holds the lock)."""
        version = entry.identity.version
        weights = self._host.get(version)
        if weights is None:
            weights = self._reads.read_now(entry)
            self._host.put(version, weights)
        return weights
