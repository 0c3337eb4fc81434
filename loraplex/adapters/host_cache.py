"""The host tier: an LRU of validated, scaled adapter weights in CPU memory.

Keyed by content version, so two ids with identical files share one entry. Entries
are never pinned: a device slot holds its own copy of the weights, and an entry that
falls out of this cache is re-read from the disk tier when it is needed again.
Thread-safe, because background loads insert while the engine thread reads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from loraplex.adapters.peft_weights import AdapterWeights


class HostAdapterCache:
    """LRU of ``version -> AdapterWeights`` holding at most ``capacity`` adapters."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"host cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, AdapterWeights] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, version: str) -> AdapterWeights | None:
        """The weights of ``version`` (marked most recently used), or None."""
        with self._lock:
            weights = self._entries.get(version)
            if weights is not None:
                self._entries.move_to_end(version)
            return weights

    def put(self, version: str, weights: AdapterWeights) -> list[str]:
        """Insert (or refresh) ``version``; return the versions evicted to make room."""
        with self._lock:
            self._entries[version] = weights
            self._entries.move_to_end(version)
            evicted = []
            while len(self._entries) > self.capacity:
                old, _ = self._entries.popitem(last=False)
                evicted.append(old)
            return evicted

    def discard(self, version: str) -> None:
        """Drop ``version`` if present."""
        with self._lock:
            self._entries.pop(version, None)

    def __contains__(self, version: object) -> bool:
        with self._lock:
            return version in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def versions(self) -> list[str]:
        """Cached versions, least recently used first."""
        with self._lock:
            return list(self._entries)

    @property
    def nbytes(self) -> int:
        """Host memory held by the cached weights."""
        with self._lock:
            return sum(w.nbytes for w in self._entries.values())
