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

The manager is the lock and the registry over three helpers that are not thread-safe on
their own: ``DeviceResidency`` (``residency.py``: slots, page tables, eviction),
``HostAdapterCache`` (``host_cache.py``) and ``StoreReads`` (``store_reads.py``: the
background reads).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from loraplex.adapters.config import AdapterManagerConfig
from loraplex.adapters.errors import AdapterValidationError, NoFreeSlotError
from loraplex.adapters.host_cache import HostAdapterCache
from loraplex.adapters.identity import AdapterIdentity
from loraplex.adapters.load_times import EMPTY_LOAD_TIMES, LoadTimes, LoadTimesSnapshot
from loraplex.adapters.page_arena import OwnedArena, PageArena
from loraplex.adapters.page_table import PageTable, pages_needed
from loraplex.adapters.peft_weights import AdapterWeights
from loraplex.adapters.registry import AdapterEntry, AdapterInfo, AdapterRegistry, Tier
from loraplex.adapters.request import LoRARequest
from loraplex.adapters.residency import DeviceResidency, PagesNeeded
from loraplex.adapters.resident import ResidentAdapter, resident_adapters
from loraplex.adapters.slot_buffers import SlotBuffers
from loraplex.adapters.spec import BaseModelSpec, GroupName
from loraplex.adapters.store import AdapterStore, StagedAdapter
from loraplex.adapters.store_reads import StoreReads
from loraplex.kernels.lora_layout import LOGICAL_LAYOUT, LoRAWeightLayout

logger = logging.getLogger(__name__)

__all__ = ["AdapterInfo", "AdapterManager", "AdapterStats", "ResidentAdapter"]


@dataclass(frozen=True)
class AdapterStats:
    """The adapter tiers at one moment: how many adapters each holds, and cumulative moves."""

    num_registered: int
    """Adapters registered (every one is on disk, in the store)."""
    max_loras: int | None
    """The cap on resident adapters, None when memory alone bounds them."""
    num_on_device: int
    """Adapters resident (pages in the device pool)."""
    num_pinned_slots: int
    """Resident adapters a running sequence uses."""
    pool_used_bytes: int
    """Bytes of adapter pages in use."""
    pool_bytes: int
    """Bytes the adapter page pools hold (used and free pages)."""
    pool_budget_bytes: int
    """``lora_memory``: the most the pools may hold."""
    pages_used: dict[str, int]
    """Pages in use per projection group."""
    num_evictions: int
    """Resident adapters evicted to make room since start-up."""
    num_in_host: int
    """Registered adapters whose weights are in host memory."""
    host_capacity: int | None
    """``max_cpu_loras``: the most adapters the host LRU holds (None: bytes alone bound it)."""
    host_bytes: int
    """Bytes of adapter weights in the host LRU."""
    host_budget_bytes: int | None
    """``cpu_lora_memory``: the most bytes the host LRU holds (None: no byte cap)."""
    num_slot_loads: int
    """Adapters written into a device slot since start-up."""
    num_disk_reads: int
    """Adapters read from the store into host memory since start-up (host-cache misses)."""
    num_loading: int
    """Background reads in flight."""
    resident: tuple[ResidentAdapter, ...] = ()
    """The adapters in device pages (``gpu``), then those only in the host LRU (``cpu``), most
    recently used first within each level."""
    load_times: LoadTimesSnapshot = EMPTY_LOAD_TIMES
    """How long each device load took (the store read of a host-cache miss included)."""


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
        max_rank = self.config.max_lora_rank
        return self._store.stage(Path(request.path).expanduser(), self.spec, max_rank, self.dtype)

    def discard_staged_lora(self, staged: StagedAdapter) -> None:
        """Give up a ``stage`` result that will not be registered (its store folder is released)."""
        if staged.owned:
            self._store.release(staged.folder)

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
            parsed = staged.parsed
            identity = AdapterIdentity(request.int_id, request.name, owner, parsed.version, served_name)
            with self._lock:
                existing = self._registry.existing(identity)
                if existing is not None:
                    self.discard_staged_lora(staged)
                    return self._info(existing)
                need = pages_needed(parsed.weights, self._pool.page_rank)  # not cached: it may be refused
                if not self._pool.can_ever_fit(need):
                    raise AdapterValidationError(
                        "exceeds_lora_memory",
                        f"its pages ({need} of {self._pool.page_rank} rank rows) take "
                        f"{self._pool.need_nbytes(need)} bytes ({self._pool.blocks_for(need)} blocks "
                        f"of the device pool), more than lora_memory ({self._pool.budget_bytes} bytes, "
                        f"{self._pool.arena.cap_blocks} blocks) holds; raise lora_memory",
                    )
                weights = self._reads.pin(parsed.weights)
                entry = AdapterEntry(
                    identity,
                    request.path,
                    staged.folder,
                    staged.owned,
                    weights.max_rank,
                    weights.target_modules,
                    weights.nbytes,
                )
                self._registry.add(entry)
                self._host.put(parsed.version, weights)
        except BaseException:
            self.discard_staged_lora(staged)
            raise
        logger.info(
            "added adapter %d %r (owner %s, rank %d, %s, version %s)",
            request.int_id,
            request.name,
            owner,
            entry.rank,
            ",".join(entry.target_modules),
            parsed.version[:12],
        )
        return self._info(entry)

    def remove_lora(self, adapter_id: int) -> AdapterInfo:
        """Unregister ``adapter_id``: new acquires fail now; running requests finish on its old weights."""
        with self._lock:
            entry = self._registry.remove(adapter_id)
            info = self._info(entry, slot_idx=self._slots.slot_of(adapter_id))
            detached = self._slots.detach(adapter_id)
            if detached is not None and detached.freed:
                self._residency.free_pages(detached.slot_idx)
            elif detached is not None:
                self._registry.start_draining(detached.slot_idx, entry)
            version = entry.identity.version
            if version not in self._registry.live_versions():
                self._host.discard(version)
                self._residency.forget(version)
                self._reads.forget(version)
            if entry.owned:
                self._store.release(entry.folder)
        logger.info(
            "removed adapter %d %r%s",
            adapter_id,
            entry.identity.name,
            f"; slot {detached.slot_idx} drains {info.num_pins} running request(s)"
            if detached is not None and not detached.freed
            else "",
        )
        return info

    def get_adapter(self, adapter_id: int) -> AdapterInfo:
        """The registered adapter ``adapter_id``; raises ``AdapterNotFoundError``/``AdapterRemovedError``."""
        with self._lock:
            return self._info(self._registry.require(adapter_id))

    def find_adapter(self, name: str, owner: str | None = None) -> AdapterInfo | None:
        """The adapter ``owner`` registered as ``name``, or None."""
        with self._lock:
            entry = self._registry.find(name, owner)
            return None if entry is None else self._info(entry)

    def list_adapters(self) -> list[AdapterInfo]:
        """Every registered adapter, by id."""
        with self._lock:
            return [self._info(entry) for entry in self._registry.entries()]

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
            self._collect_loads()
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
            self._collect_loads()
            entry = self._registry.require(adapter_id)
            version = entry.identity.version
            if self._slots.slot_of(adapter_id) is not None or version in self._host:
                return True
            error = self._reads.take_error(version)
            if error is not None:
                raise error
            if start:
                self._reads.submit(entry)
            return False

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
            self._collect_loads()
            host_room = self._host.max_bytes // 2 if self._host.max_bytes is not None else None
            if self._host.capacity is not None:
                max_adapters = min(max_adapters, max(1, self._host.capacity // 2))
            wanted: dict[str, AdapterEntry] = {}  # to read
            counted: set[str] = set()  # every version within the bounds, in host or not
            nbytes = 0
            for adapter_id in adapter_ids:
                if len(counted) >= max_adapters:
                    break
                entry = self._registry.get(adapter_id)
                if entry is None or self._slots.slot_of(adapter_id) is not None:
                    continue
                version = entry.identity.version
                if version in counted:
                    continue
                if counted and host_room is not None and nbytes + entry.host_nbytes > host_room:
                    break
                counted.add(version)
                nbytes += entry.host_nbytes
                # Already read ahead: keep it the most recently used, so reads for later
                # requests push out something else (the bounds count it either way).
                if self._host.get(version) is None:
                    wanted[version] = entry
            cancelled = self._reads.cancel_except(wanted)
            for version, entry in wanted.items():
                if not self._reads.failed(version):
                    self._reads.submit(entry)
            if cancelled:
                logger.debug("cancelled %d queued adapter reads nobody waits for", cancelled)

    def wait_for_a_read(self, timeout: float) -> bool:
        """Block (without the manager lock) until a background store read in flight finishes,
        at most ``timeout`` seconds; True if one did, or if one had finished since the last
        look (it is moved to the host cache now, without waiting). Either way a True means
        news: a read that no call has collected yet (a caller may loop on it)."""
        with self._lock:
            if self._collect_loads():
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
                self._residency.free_pages(unpinned.slot_idx)
                entry = self._registry.finish_draining(unpinned.slot_idx)
                logger.info(
                    "slot %d of removed adapter %d is free", unpinned.slot_idx, entry.identity.adapter_id
                )
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
            entries = self._registry.entries()
            on_device = sum(self._slots.slot_of(e.identity.adapter_id) is not None for e in entries)
            in_host = sum(e.identity.version in self._host for e in entries)
            return AdapterStats(
                resident=resident_adapters(entries, self._slots, self._host),
                load_times=self._load_times.snapshot(),
                num_registered=len(entries),
                max_loras=self.config.max_loras,
                num_on_device=on_device,
                num_pinned_slots=self._slots.num_pinned,
                pool_used_bytes=self._pool.used_nbytes,
                pool_bytes=self._pool.nbytes,
                pool_budget_bytes=self._pool.budget_bytes,
                pages_used={g: self._pool.num_used(g) for g in self._pool.groups()},
                num_evictions=self._residency.num_evictions,
                num_in_host=in_host,
                host_capacity=self.config.max_cpu_loras,
                host_bytes=self._host.nbytes,
                host_budget_bytes=self.config.cpu_lora_memory,
                num_slot_loads=self._residency.num_slot_loads,
                num_disk_reads=self._reads.num_reads,
                num_loading=self._reads.num_in_flight,
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
            errors: list[str] = []
            draining = self._registry.draining()
            errors += self._residency.check()
            for slot_idx in self._slots.slots_in_use():
                key = self._slots.key_of(slot_idx)
                assert key is not None
                if self._slots.is_draining(slot_idx):
                    drained = draining.get(slot_idx)
                    if drained is None or drained.identity.adapter_id != key:
                        errors.append(f"draining slot {slot_idx} has no matching removed adapter")
                elif self._registry.get(key) is None:
                    errors.append(f"slot {slot_idx} holds unregistered adapter {key}")
            for slot_idx in draining:
                if not self._slots.is_draining(slot_idx):
                    errors.append(f"removed adapter recorded on slot {slot_idx}, which is not draining")
            live_versions = self._registry.live_versions()
            stray = set(self._host.versions()) - live_versions
            if stray:
                errors.append(f"host cache holds versions of no registered adapter: {sorted(stray)}")
            errors += self._host.check()
            users: dict[Path, int] = {}
            for e in self._registry.entries():
                if e.owned:
                    users[e.folder] = users.get(e.folder, 0) + 1
            # After close() the store's folders are gone on purpose; the registry keeps its records.
            if not self._closed and users != self._store.owned_folders:
                errors.append(f"store folders {self._store.owned_folders} != registered users {users}")
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

    def _info(self, entry: AdapterEntry, slot_idx: int | None = None) -> AdapterInfo:
        adapter_id = entry.identity.adapter_id
        if slot_idx is None and self._registry.get(adapter_id) is entry:
            slot_idx = self._slots.slot_of(adapter_id)
        tier: Tier = (
            "device" if slot_idx is not None else "host" if entry.identity.version in self._host else "disk"
        )
        pins = self._slots.pin_count(slot_idx) if slot_idx is not None else 0
        return AdapterInfo(
            entry.identity,
            entry.source,
            entry.folder,
            entry.rank,
            entry.target_modules,
            entry.host_nbytes,
            tier,
            slot_idx,
            pins,
        )

    def _collect_loads(self) -> int:
        """Move finished background reads into the host cache (caller holds the lock); how many."""
        return self._reads.collect(self._host, self._registry.live_versions())

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
