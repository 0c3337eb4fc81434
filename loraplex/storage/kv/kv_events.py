"""KV cache events: what the cache tells an outside router about the blocks it holds, per tier.

A router that sends a request to the replica holding its prefix (llm-d's precise prefix scorer)
keeps an index of every replica's blocks, fed by these events (vLLM's ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared``; the engine's ``kv_events`` package encodes them).
They are values emitted where a block becomes findable or stops being findable, in its tier::

    BlocksStored(keys, parent, token_ids, medium, owner, origin)
        GPU      the prefix cache registered computed blocks (with their tokens and parent), or a
                 promotion from host/disk landed (tokens and parent not at hand: empty / None)
        CPU      a block was demoted into host RAM;   STORAGE  into the disk tier
    BlocksRemoved(keys, medium)
        GPU      a cached device block was evicted (reused, lent to the adapter arena) or purged
        CPU / STORAGE   a lower tier dropped it: promoted up, pushed down or out, purged,
                 or superseded by a copy the device computed again
    AllCleared()        a prefix-cache reset: every tier at once (no per-block events follow)

A block that is merely freed (ref count 0) stays findable, so it is no event; one that moves
down a tier is a ``BlocksRemoved`` above and a ``BlocksStored`` below. Swap blocks (a preempted
sequence's private tail) are never findable by a prefix and are never reported.

``KVEventLog`` collects the events of one engine between two flushes: the pools call ``emit``
(the device pool on the engine's thread, the tiers under their lock, the disk tier's workers on
theirs), the engine ``take``s the batch after each step. ``emit`` is a list append under a lock:
nothing here encodes or waits. A log that is not ``enabled`` drops at once, so a cache with
events off pays one attribute test per event.

``owner`` is the tenant's cache salt (b"": nobody's) and ``origin`` names the adapter, so the
router can key a prefix per adapter and per tenant; the encoder publishes a digest of the
salt, never the salt itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, NamedTuple

from loraplex.storage.kv.block_hash import KEY_BYTES

Medium = Literal["GPU", "CPU", "STORAGE"]
"""vLLM's names of a tier: the accelerator's pool (also on a CPU-only engine), host RAM, disk."""

GPU: Medium = "GPU"
CPU: Medium = "CPU"
STORAGE: Medium = "STORAGE"


class BlockOrigin(NamedTuple):
    """Which adapter a sequence's blocks were computed with, as a router names it."""

    lora_name: str | None
    """The adapter's served name (what clients put in ``model``); None for the base model."""
    lora_id: int | None
    """The engine's adapter id (the same on every replica of a gateway); None for the base model."""


NO_ORIGIN = BlockOrigin(None, None)


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """A run of blocks became findable in ``medium``; ``parent`` is the key before the first one
    (None at a prompt's start, or when not known: tier moves)."""

    keys: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]
    """The blocks' tokens, in order (empty when not known: demotions and promotions)."""
    medium: Medium
    owner: bytes = b""
    origin: BlockOrigin = NO_ORIGIN


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """Blocks that stopped being findable in ``medium``."""

    keys: tuple[bytes, ...]
    medium: Medium


@dataclass(frozen=True, slots=True)
class AllCleared:
    """Every cached block of every tier is gone (a prefix-cache reset)."""


KVEvent = BlocksStored | BlocksRemoved | AllCleared


def prefix_keys(keys: Iterable[bytes]) -> tuple[bytes, ...]:
    """The prefix-cache keys among ``keys``: a swap block's private key is shorter (16 bytes,
    ``tiers.transfers``) and no router may hear of it."""
    return tuple(key for key in keys if len(key) == KEY_BYTES)


class KVEventLog:
    """The events of one cache since the last ``take`` (thread-safe, never blocks for long)."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._events: list[KVEvent] = []

    def emit(self, event: KVEvent) -> None:
        """Record ``event`` (nothing when disabled)."""
        if self.enabled:
            with self._lock:
                self._events.append(event)

    def stored(self, keys: Iterable[bytes], medium: Medium, owner: bytes = b"") -> None:
        """Record that prefix blocks ``keys`` moved into ``medium`` (swap keys skipped)."""
        if self.enabled:
            found = prefix_keys(keys)
            if found:
                self.emit(BlocksStored(found, None, (), medium, owner))

    def removed(self, keys: Iterable[bytes], medium: Medium) -> None:
        """Record that prefix blocks ``keys`` left ``medium`` (swap keys skipped)."""
        if self.enabled:
            found = prefix_keys(keys)
            if found:
                self.emit(BlocksRemoved(found, medium))

    def take(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)
