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
or pages (past ``lora_memory``). ``remove_adapter`` refuses new requests at once,
while requests already pinned to the adapter's slot finish on its old weights; the
slot frees with its last ``release``.

Threading: every public method may be called from any thread (one re-entrant lock).
Disk reads for ``prefetch`` run on loader threads without that lock; their results
are collected by the next call from the engine, so a slow read never blocks requests
for other adapters. ``add_adapter`` validates outside the lock for the same reason.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from loraplex.adapters.config import AdapterManagerConfig
from loraplex.adapters.errors import AdapterValidationError, NoFreeSlotError
from loraplex.adapters.host_cache import HostAdapterCache
from loraplex.adapters.identity import AdapterIdentity
from loraplex.adapters.page_arena import OwnedArena, PageArena
from loraplex.adapters.page_pool import LoRAPagePool, PageTable, Remaps, pages_needed
from loraplex.adapters.peft_weights import AdapterWeights
from loraplex.adapters.registry import AdapterEntry, AdapterInfo, AdapterRegistry, Tier
from loraplex.adapters.request import LoRARequest
from loraplex.adapters.slot_buffers import SlotBuffers
from loraplex.adapters.slot_table import SlotTable
from loraplex.adapters.spec import BaseModelSpec, GroupName
from loraplex.adapters.store import AdapterStore, StagedAdapter
from loraplex.kernels.lora_layout import LOGICAL_LAYOUT, LoRAWeightLayout

logger = logging.getLogger(__name__)

__all__ = ["AdapterInfo", "AdapterManager", "AdapterStats"]


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
        self._slots = SlotTable(self.config.max_loras)
        if arena is None:
            arena = OwnedArena(spec.num_layers, self.config.lora_memory, self.device)
        self._pool = LoRAPagePool(
            spec,
            self.config.lora_page_rank,
            arena,
            self.device,
            dtype,
            layout=weight_layout,
        )
        self._pages: dict[int, PageTable] = {}  # slot -> its adapter's pages
        self._need: dict[str, dict[GroupName, int]] = {}  # version -> pages per group (cached)
        self._registry = AdapterRegistry()
        self._loads: dict[str, Future[AdapterWeights]] = {}  # version -> background disk read
        self._load_errors: dict[str, BaseException] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.RLock()
        self._closed = False
        """close() ran: the store's folders are deleted (what check_integrity compares is gone)."""
        self._num_slot_loads = 0  # adapters written into device pages
        self._num_evictions = 0
        self._num_disk_reads = 0  # adapters read back from the store into host memory

    # -- registry ----------------------------------------------------------------------

    def add_adapter(self, request: LoRARequest, owner: str | None = None) -> AdapterInfo:
        """Validate the adapter at ``request.path`` and register it under ``request.int_id``.

        Raises ``AdapterValidationError`` (nothing registered, no files left behind) or
        ``AdapterExistsError`` if the id or ``(owner, name)`` is taken by other content.
        Adding the very same adapter again returns the existing entry.
        """
        return self.register(request, self.stage(request), owner)

    def stage(self, request: LoRARequest) -> StagedAdapter:
        """The slow half of ``add_adapter``: validate and store the files (any thread, no lock held).

        Changes nothing the scheduler sees; hand the result to ``register`` (or ``discard_staged``).
        """
        max_rank = self.config.max_lora_rank
        return self._store.stage(Path(request.path).expanduser(), self.spec, max_rank, self.dtype)

    def discard_staged(self, staged: StagedAdapter) -> None:
        """Give up a ``stage`` result that will not be registered (its store folder is released)."""
        if staged.owned:
            self._store.release(staged.folder)

    def register(self, request: LoRARequest, staged: StagedAdapter, owner: str | None = None) -> AdapterInfo:
        """The fast half of ``add_adapter``: register validated files under ``request.int_id``.

        Raises ``AdapterExistsError`` if the id or ``(owner, name)`` is taken by other content
        (``staged`` is released then); the very same adapter again returns the existing entry.
        """
        try:
            parsed = staged.parsed
            identity = AdapterIdentity(request.int_id, request.name, owner, parsed.version)
            with self._lock:
                existing = self._registry.existing(identity)
                if existing is not None:
                    self.discard_staged(staged)
                    return self._info(existing)
                need = pages_needed(parsed.weights, self._pool.page_rank)
                if not self._pool.can_ever_fit(need):
                    raise AdapterValidationError(
                        "exceeds_lora_memory",
                        f"its pages ({need} of {self._pool.page_rank} rank rows) take "
                        f"{self._pool.need_nbytes(need)} bytes ({self._pool.blocks_for(need)} blocks "
                        f"of the device pool), more than lora_memory ({self._pool.budget_bytes} bytes, "
                        f"{self._pool.arena.cap_blocks} blocks) holds; raise lora_memory",
                    )
                weights = self._maybe_pin(parsed.weights)
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
            self.discard_staged(staged)
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

    def remove_adapter(self, adapter_id: int) -> AdapterInfo:
        """Unregister ``adapter_id``: new acquires fail now; running requests finish on its old weights."""
        with self._lock:
            entry = self._registry.remove(adapter_id)
            info = self._info(entry, slot_idx=self._slots.slot_of(adapter_id))
            detached = self._slots.detach(adapter_id)
            if detached is not None and detached.freed:
                self._free_pages(detached.slot_idx)
            elif detached is not None:
                self._registry.start_draining(detached.slot_idx, entry)
            version = entry.identity.version
            if version not in self._registry.live_versions():
                self._host.discard(version)
                self._need.pop(version, None)
                self._load_errors.pop(version, None)
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
            return weights is not None and self._could_make_room(self._pages_needed(entry, weights))

    def could_ever_fit_beside(self, adapter_id: int, kv_blocks: int) -> bool:
        """Whether ``adapter_id``'s pages could fit the arena while ``kv_blocks`` of KV are in
        use, every other adapter evicted (False: a request that large never runs on it)."""
        with self._lock:
            entry = self._registry.require(adapter_id)
            weights = self._host.get(entry.identity.version)
            if weights is None:
                return True  # not known yet: the load will tell
            need = self._pages_needed(entry, weights)
            return self._pool.blocks_for(need) <= self._pool.arena.max_blocks_beside(kv_blocks)

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
            error = self._load_errors.pop(version, None)
            if error is not None:
                raise error
            if start and version not in self._loads:
                self._submit(entry)
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
            cancelled = [v for v, f in self._loads.items() if v not in wanted and f.cancel()]
            for version in cancelled:
                del self._loads[version]
            for version, entry in wanted.items():
                if version not in self._loads and version not in self._load_errors:
                    self._submit(entry)
            if cancelled:
                logger.debug("cancelled %d queued adapter reads nobody waits for", len(cancelled))

    def wait_for_a_read(self, timeout: float) -> bool:
        """Block (without the manager lock) until a background store read in flight finishes,
        at most ``timeout`` seconds; True if one did. Reads that finished earlier are moved to
        the host cache first, so a True always means news (a caller may loop on it)."""
        with self._lock:
            self._collect_loads()
            pending = list(self._loads.values())
        if not pending:
            return False
        done, _ = wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
        return bool(done)

    def _submit(self, entry: AdapterEntry) -> None:
        """Queue a background store read of ``entry`` (caller holds the lock)."""
        if self._executor is None:
            threads = self.config.num_loader_threads
            self._executor = ThreadPoolExecutor(threads, thread_name_prefix="adapter-loader")
        self._loads[entry.identity.version] = self._executor.submit(self._read_from_disk, entry)
        logger.debug("prefetching adapter %d from %s", entry.identity.adapter_id, entry.folder)

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
                weights = self._host_weights(entry)
                need = self._pages_needed(entry, weights)
                evicted = self._make_room(adapter_id, need, keep_free_blocks)
                pages, moved = self._pool.allocate(need, keep_free_blocks)
                self._follow(moved)
                self._pool.write(pages, weights)
                new_slot = self._slots.new_slot()
                assert new_slot is not None, "make_room left no slot"
                slot_idx = new_slot
                self._slots.assign(slot_idx, adapter_id)
                self._pages[slot_idx] = pages
                self._num_slot_loads += 1
                logger.debug("loaded adapter %d: slot %d, pages %s", adapter_id, slot_idx, pages)
                if evicted:
                    logger.debug("evicted adapters %s for adapter %d", evicted, adapter_id)
            self._slots.pin(slot_idx, request_id)
            return slot_idx

    def release(self, request_id: str) -> bool:
        """Drop ``request_id``'s pin (finish, abort, preemption); False if it held none."""
        with self._lock:
            unpinned = self._slots.unpin(request_id)
            if unpinned is None:
                return False
            if unpinned.freed:
                self._free_pages(unpinned.slot_idx)
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
            return {slot: {g: list(p) for g, p in table.items()} for slot, table in self._pages.items()}

    def pages_of(self, adapter_id: int) -> PageTable | None:
        """The pages of resident ``adapter_id`` per group, or None if it is not resident."""
        with self._lock:
            slot_idx = self._slots.slot_of(adapter_id)
            return None if slot_idx is None else {g: list(p) for g, p in self._pages[slot_idx].items()}

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
                num_registered=len(entries),
                max_loras=self.config.max_loras,
                num_on_device=on_device,
                num_pinned_slots=self._slots.num_pinned,
                pool_used_bytes=self._pool.used_nbytes,
                pool_bytes=self._pool.nbytes,
                pool_budget_bytes=self._pool.budget_bytes,
                pages_used={g: self._pool.num_used(g) for g in self._pool.groups()},
                num_evictions=self._num_evictions,
                num_in_host=in_host,
                host_capacity=self.config.max_cpu_loras,
                host_bytes=self._host.nbytes,
                host_budget_bytes=self.config.cpu_lora_memory,
                num_slot_loads=self._num_slot_loads,
                num_disk_reads=self._num_disk_reads,
                num_loading=len(self._loads),
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
            in_use = self._slots.slots_in_use()
            if sorted(self._pages) != in_use:
                errors.append(f"slots with pages {sorted(self._pages)} != slots in use {in_use}")
            errors += self._pool.check(self._pages)
            for slot_idx in in_use:
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
            executor, self._executor = self._executor, None
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

    def _maybe_pin(self, weights: AdapterWeights) -> AdapterWeights:
        if self.device.type == "cuda" and torch.cuda.is_available():
            return weights.pin_memory()
        return weights

    def _read_from_disk(self, entry: AdapterEntry) -> AdapterWeights:
        """Runs on a loader thread (no manager lock): re-read and re-validate the stored files."""
        parsed = self._store.load(
            entry.folder, self.spec, self.config.max_lora_rank, self.dtype, entry.identity.version
        )
        return self._maybe_pin(parsed.weights)

    def _collect_loads(self) -> None:
        """Move finished background reads into the host cache (caller holds the lock)."""
        live_versions = self._registry.live_versions()
        for version, future in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[version]
            if version not in live_versions:
                continue  # removed while loading
            error = future.exception()
            if error is not None:
                logger.warning("background load of adapter version %s failed: %s", version[:12], error)
                self._load_errors[version] = error
            else:
                self._host.put(version, future.result())
                self._num_disk_reads += 1

    def _pages_needed(self, entry: AdapterEntry, weights: AdapterWeights) -> dict[GroupName, int]:
        version = entry.identity.version
        need = self._need.get(version)
        if need is None:
            need = self._need[version] = pages_needed(weights, self._pool.page_rank)
        return need

    def _follow(self, moved: Remaps) -> None:
        """Point the page tables at the pages a compaction moved."""
        for group, remap in moved.items():
            for table in self._pages.values():
                if group in table:
                    table[group] = [remap.get(p, p) for p in table[group]]

    def _could_make_room(self, need: dict[GroupName, int], keep_free_blocks: int = 0) -> bool:
        """Whether a slot and ``need`` pages could be had now, evicting unpinned adapters if need be."""
        evictable = self._slots.eviction_order()
        if not self._slots.has_room() and not evictable:
            return False
        freeable: dict[GroupName, int] = {}
        for slot_idx in evictable:
            for group, pages in self._pages[slot_idx].items():
                freeable[group] = freeable.get(group, 0) + len(pages)
        return self._pool.fits(need, freed=freeable, keep_free_blocks=keep_free_blocks)

    def give_back_memory(self, num_blocks: int) -> int:
        """Return arena blocks to the KV cache, evicting unpinned adapters (least recently
        used first) until ``num_blocks`` came back or nothing more can; how many came back.

        The engine calls this before it would preempt a sequence or refuse one for KV: the
        KV cache comes first, adapters no running request uses yield to it.
        """
        with self._lock:
            before = self._pool.arena.num_blocks
            target = max(0, before - num_blocks)
            order = self._slots.eviction_order()
            used = {g: self._pool.num_used(g) for g in self._pool.groups()}
            evictable = [(slot_idx, self._pages[slot_idx]) for slot_idx in order]
            for _, table in evictable:
                for group, pages in table.items():
                    used[group] -= len(pages)
            # All or nothing: a partial return would cost reloads (and a re-layout of the
            # arena) and still leave the sequence without its blocks.
            if self._pool.blocks_for(used) > target:
                return 0
            for slot_idx, _ in evictable:
                tight = {g: self._pool.num_used(g) for g in self._pool.groups()}
                if self._pool.blocks_for(tight) <= target:
                    break  # free pages (growth slack) and the adapters evicted so far suffice
                self._slots.evict(slot_idx)
                self._free_pages(slot_idx)
                self._num_evictions += 1
            self._follow(self._pool.shrink())
            return before - self._pool.arena.num_blocks

    def _make_room(self, adapter_id: int, need: dict[GroupName, int], keep_free_blocks: int = 0) -> list[int]:
        """Evict least recently used unpinned adapters until a slot and ``need`` pages are free.

        Pages of any group count (the pool compacts groups to move bytes between them), so
        eviction simply follows the LRU order. Raises ``NoFreeSlotError`` when what is
        evictable does not suffice (nothing is evicted then).
        """
        if not self._could_make_room(need, keep_free_blocks):
            raise NoFreeSlotError(
                f"adapter {adapter_id}: its pages ({need} of rank {self._pool.page_rank}) do not fit "
                f"the adapter memory now ({self._pool.arena.max_blocks()} blocks: lora_memory "
                f"{self._pool.budget_bytes} bytes at most, within the free KV blocks) beside the "
                "adapters running requests use; retry when one finishes"
            )
        evicted: list[int] = []
        for slot_idx in self._slots.eviction_order():
            if self._pool.fits(need, keep_free_blocks=keep_free_blocks) and self._slots.has_room():
                break
            evicted.append(self._slots.evict(slot_idx))
            self._free_pages(slot_idx)
            self._num_evictions += 1
        return evicted

    def _held_nbytes(self, slot_idx: int) -> int:
        return self._pool.need_nbytes({g: len(p) for g, p in self._pages[slot_idx].items()})

    def _free_pages(self, slot_idx: int) -> None:
        self._pool.free(self._pages.pop(slot_idx))

    def _host_weights(self, entry: AdapterEntry) -> AdapterWeights:
        """The adapter's host weights, reading them from disk now on a miss (caller holds the lock)."""
        version = entry.identity.version
        weights = self._host.get(version)
        if weights is not None:
            return weights
        future = self._loads.pop(version, None)
        # The loader thread never takes the manager lock, so waiting here cannot deadlock.
        weights = future.result() if future is not None else self._read_from_disk(entry)
        self._num_disk_reads += 1
        self._load_errors.pop(version, None)
        self._host.put(version, weights)
        return weights
