"""Prefetching: store reads that bring adapters into host memory before a request needs them.

``prefetch`` starts the read of one adapter a waiting request wants (and raises its failed
read, once); ``ahead`` reads for the next requests to admit, within half the host cache, and
cancels the queued reads nobody waits for any more; ``collect`` moves finished reads into
the host cache. The reads run on ``StoreReads``' loader threads, without the manager's lock.

Not thread-safe: the ``AdapterManager`` calls it under its lock.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from loraplex.adapters.host_cache import HostAdapterCache
from loraplex.adapters.registry import AdapterEntry, AdapterRegistry
from loraplex.adapters.slot_table import SlotTable
from loraplex.adapters.store_reads import StoreReads

logger = logging.getLogger(__name__)


class Prefetcher:
    """Background reads from the store into the host cache: which to start, keep and cancel."""

    def __init__(
        self, registry: AdapterRegistry, slots: SlotTable, host: HostAdapterCache, reads: StoreReads
    ) -> None:
        self._registry = registry
        self._slots = slots
        self._host = host
        self._reads = reads

    def collect(self) -> int:
        """Move finished background reads into the host cache; how many finished."""
        return self._reads.collect(self._host, self._registry.live_versions())

    def prefetch(self, adapter_id: int, start: bool) -> bool:
        """Start reading ``adapter_id`` (unless ``start`` is False); True if resident or in host
        memory. Raises a failed read of it (once), and for an unregistered adapter."""
        self.collect()
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

    def ahead(self, adapter_ids: Iterable[int], max_adapters: int) -> None:
        """Read ahead for ``adapter_ids`` in order, within half the host cache; cancel the
        queued reads of any other adapter (``AdapterManager.prefetch_ahead`` says why)."""
        self.collect()
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
