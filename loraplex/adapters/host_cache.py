"""The host tier: an LRU of validated, scaled adapter weights in CPU memory.

Keyed by content version, so two ids with identical files share one entry. Bounded by
bytes (``cpu_lora_memory``: adapters of any rank share it fairly) and optionally by a
count (``max_cpu_loras``, vLLM's name). Entries are never pinned: a device page holds its
own copy of the weights, and an entry that falls out of this cache is re-read from the
disk tier when it is needed again. Thread-safe, because background loads insert while
the engine thread reads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from loraplex.adapters.peft_weights import AdapterWeights


class HostAdapterCache:
    """LRU of ``version -> AdapterWeights`` within ``max_bytes`` (and ``capacity`` entries)."""

    def __init__(self, capacity: int | None, max_bytes: int | None = None) -> None:
        """``capacity``: most entries (None: no count cap); ``max_bytes``: most bytes of
        weights (None: no byte cap). The newest entry always stays, even alone over the bytes."""
        if capacity is not None and capacity < 1:
            raise ValueError(f"host cache capacity must be >= 1, got {capacity}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"host cache max_bytes must be >= 1, got {max_bytes}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, AdapterWeights] = OrderedDict()
        self._nbytes = 0
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
            old = self._entries.pop(version, None)
            if old is not None:
                self._nbytes -= old.nbytes
            self._entries[version] = weights
            self._nbytes += weights.nbytes
            evicted = []
            while len(self._entries) > 1 and self._over():
                gone, dropped = self._entries.popitem(last=False)
                self._nbytes -= dropped.nbytes
                evicted.append(gone)
            return evicted

    def _over(self) -> bool:
        return (self.capacity is not None and len(self._entries) > self.capacity) or (
            self.max_bytes is not None and self._nbytes > self.max_bytes
        )

    def discard(self, version: str) -> None:
        """Drop ``version`` if present."""
        with self._lock:
            weights = self._entries.pop(version, None)
            if weights is not None:
                self._nbytes -= weights.nbytes

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
            return self._nbytes

    def check(self) -> list[str]:
        """Inconsistencies (for ``check_integrity``): the byte count, the caps."""
        with self._lock:
            errors = []
            actual = sum(w.nbytes for w in self._entries.values())
            if actual != self._nbytes:
                errors.append(f"host cache counts {self._nbytes} bytes, holds {actual}")
            if len(self._entries) > 1 and self._over():
                errors.append(
                    f"host cache holds {len(self._entries)} adapters / {actual} bytes, over its caps "
                    f"({self.capacity} adapters, {self.max_bytes} bytes)"
                )
            return errors
