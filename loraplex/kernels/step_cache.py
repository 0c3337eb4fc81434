"""A small cache keyed by object identity, for what a backend derives from a step's metadata.

One step's LoRA metadata is read by every layer; a paged step has one metadata per
projection group (and per page pass), so a backend sees a handful of distinct objects
per step, each many times. Entries keep their key alive, so an id is never reused while
its entry exists; the cache is cleared whole when it fills (a new step brings new keys).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class IdentityCache(Generic[K, V]):
    """``get(key, build)``: ``build(key)`` once per live key object."""

    def __init__(self, max_entries: int = 16) -> None:
        self.max_entries = max_entries
        self._entries: dict[int, tuple[K, V]] = {}

    def get(self, key: K, build: Callable[[K], V]) -> V:
        hit = self._entries.get(id(key))
        if hit is not None and hit[0] is key:
            return hit[1]
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        value = build(key)
        self._entries[id(key)] = (key, value)
        return value
