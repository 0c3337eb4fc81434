"""Registration: an adapter's entry into the tiers and its exit from them.

``stage`` validates and stores an upload (any thread: only the store changes);
``register`` makes a staged adapter servable: refused if its pages could never fit
``lora_memory``, else an ``AdapterEntry`` in the registry and its weights in the host cache.
``remove`` refuses new requests at once; a slot still pinned drains (its running requests
finish on the old weights) and a version no live adapter shares leaves every tier.
``info`` is what ``AdapterInfo`` says of an entry (its tier, slot, pins), and ``check`` the
registry's agreement with the tiers (draining slots, host versions, store folders).

Not thread-safe: the ``AdapterManager`` calls everything but ``stage`` and ``discard`` under
its lock.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from loraplex.adapters.errors import AdapterValidationError
from loraplex.adapters.host_cache import HostAdapterCache
from loraplex.adapters.identity import AdapterIdentity
from loraplex.adapters.page_table import pages_needed
from loraplex.adapters.registry import AdapterEntry, AdapterInfo, AdapterRegistry, Tier
from loraplex.adapters.request import LoRARequest
from loraplex.adapters.residency import DeviceResidency
from loraplex.adapters.spec import BaseModelSpec
from loraplex.adapters.store import AdapterStore, StagedAdapter
from loraplex.adapters.store_reads import StoreReads

logger = logging.getLogger(__name__)


class Registration:
    """Adds adapters to the registry and the tiers, removes them, and describes them."""

    def __init__(
        self,
        spec: BaseModelSpec,
        max_lora_rank: int,
        dtype: torch.dtype,
        store: AdapterStore,
        registry: AdapterRegistry,
        host: HostAdapterCache,
        reads: StoreReads,
        residency: DeviceResidency,
    ) -> None:
        self._spec = spec
        self._max_lora_rank = max_lora_rank
        self._dtype = dtype
        self._store = store
        self._registry = registry
        self._host = host
        self._reads = reads
        self._residency = residency
        self._slots = residency.slots
        self._pool = residency.pool

    def stage(self, request: LoRARequest) -> StagedAdapter:
        """Validate and store the files at ``request.path`` (any thread)."""
        path = Path(request.path).expanduser()
        return self._store.stage(path, self._spec, self._max_lora_rank, self._dtype)

    def discard(self, staged: StagedAdapter) -> None:
        """Release the store folder of a staged adapter that will not be registered."""
        if staged.owned:
            self._store.release(staged.folder)

    def register(
        self, request: LoRARequest, staged: StagedAdapter, owner: str | None, served_name: str | None
    ) -> AdapterInfo:
        """Register ``staged`` under ``request.int_id``; the very same adapter again returns the
        existing entry (``staged`` is discarded then). Raises ``AdapterExistsError`` and
        ``AdapterValidationError`` (``exceeds_lora_memory``); the caller discards ``staged`` then."""
        parsed = staged.parsed
        identity = AdapterIdentity(request.int_id, request.name, owner, parsed.version, served_name)
        existing = self._registry.existing(identity)
        if existing is not None:
            self.discard(staged)
            return self.info(existing)
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
        logger.info(
            "added adapter %d %r (owner %s, rank %d, %s, version %s)",
            request.int_id,
            request.name,
            owner,
            entry.rank,
            ",".join(entry.target_modules),
            parsed.version[:12],
        )
        return self.info(entry)

    def remove(self, adapter_id: int) -> AdapterInfo:
        """Unregister ``adapter_id``; its slot drains if pinned; its version leaves every tier
        unless another live adapter shares it. What it was, as ``AdapterInfo``."""
        entry = self._registry.remove(adapter_id)
        info = self.info(entry, slot_idx=self._slots.slot_of(adapter_id))
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

    def finish_draining(self, slot_idx: int) -> None:
        """The last pin on a removed adapter's slot is gone: free its pages, forget the record."""
        self._residency.free_pages(slot_idx)
        entry = self._registry.finish_draining(slot_idx)
        logger.info("slot %d of removed adapter %d is free", slot_idx, entry.identity.adapter_id)

    def info(self, entry: AdapterEntry, slot_idx: int | None = None) -> AdapterInfo:
        """``entry`` as clients see it: its tier, slot and pins (``slot_idx``: the slot it had,
        for an entry just removed)."""
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

    def check(self, store_closed: bool) -> list[str]:
        """Where the registry and the tiers disagree (empty: nowhere). ``store_closed``: the
        store's folders were deleted on purpose (the registry keeps its records)."""
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
        if not store_closed and users != self._store.owned_folders:
            errors.append(f"store folders {self._store.owned_folders} != registered users {users}")
        return errors
