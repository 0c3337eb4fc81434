"""Which disk slot holds what: the disk tier's slot state machine, without I/O or threads.

Each slot is in exactly one state; ``check`` asserts it and that the sizes add up::

    free     queued for the next demotion
    pending  a write in flight for a live key (findable; fetches are served from memory)
    ready    a published record, in the LRU index
    limbo    owned by no key, but still pinned by a reader or written by a worker

    claim()              free -> (a write starts), or the LRU unpinned ready slot (an eviction)
    start_write(write)   -> pending
    finish_write(w, ok)  pending -> ready (ok) or limbo -> free (failed, or removed meanwhile)
    pin(key) / unpin     a read in flight: the slot cannot be evicted or reused under it
    drop(key)            ready or pending -> limbo -> free once no read or write holds it

A key takes its place in the LRU order when its write starts, not when the write
ends (writes finish out of order on several workers). ``DiskKVPool`` owns one table
and calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class PendingWrite:
    """A block on its way to a slot file."""

    key: bytes
    slot: int
    data: torch.Tensor  # the caller's block, copied: serves fetches until published
    future: Future[bool] | None = None
    cancelled: bool = False  # removed while in flight: never published
    owner: bytes = b""  # the tenant's cache salt (b"": nobody's)


class SlotTable:
    """Slot states, the LRU index of published records, and read pins (not thread-safe)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # Every held key (pending or ready) -> its slot, least recently used first.
        self.index: OrderedDict[bytes, int] = OrderedDict()
        self.pending: dict[bytes, PendingWrite] = {}
        self.owners: dict[bytes, bytes] = {}  # held key -> its owner, when it has one
        self._limbo: set[int] = set()
        self._free: deque[int] = deque()
        self._owner: list[bytes | None] = [None] * num_slots
        self._pins = [0] * num_slots
        self._writing: set[int] = set()

    def restore(self, records: Iterable[tuple[bytes, int, bytes]]) -> None:
        """Start from ``(key, slot, owner)`` records, oldest first; every other slot is free."""
        for key, slot, owner in records:
            self.index[key] = slot
            self._owner[slot] = key
            if owner:
                self.owners[key] = owner
        self._free.extend(s for s in range(self.num_slots) if self._owner[s] is None)

    # -- queries ---------------------------------------------------------------
    @property
    def num_used(self) -> int:
        return len(self.index)

    def contains(self, key: bytes) -> bool:
        return key in self.index

    def is_published(self, key: bytes) -> bool:
        return key in self.index and key not in self.pending

    def slot_of(self, key: bytes) -> int | None:
        return self.index.get(key)

    def held_keys(self) -> list[bytes]:
        """Least recently used first."""
        return list(self.index)

    def keys_of(self, owner: bytes) -> list[bytes]:
        """The held keys ``owner`` owns."""
        return [key for key, by in self.owners.items() if by == owner]

    def is_free(self, slot: int) -> bool:
        """True if no key, read or write holds ``slot`` (O(1), unlike scanning ``free_slots``)."""
        return (
            self._owner[slot] is None
            and slot not in self._limbo
            and slot not in self._writing
            and self._pins[slot] == 0
        )

    def free_slots(self) -> list[int]:
        """Slots no key, read or write holds (their files may still carry an old record)."""
        return list(self._free)

    # -- transitions -----------------------------------------------------------
    def claim(self) -> tuple[int, bytes | None] | None:
        """A slot for a new write and the key evicted for it (None if it was free); None if none."""
        if self._free:
            return self._free.popleft(), None
        for key, slot in self.index.items():
            if self._pins[slot] == 0 and key not in self.pending:
                del self.index[key]
                self.owners.pop(key, None)
                self._owner[slot] = None
                return slot, key
        return None

    def start_write(self, write: PendingWrite) -> None:
        self._owner[write.slot] = write.key
        self.index[write.key] = write.slot
        self.pending[write.key] = write
        if write.owner:
            self.owners[write.key] = write.owner
        self._writing.add(write.slot)

    def finish_write(self, write: PendingWrite, ok: bool) -> bool:
        """The write ended; True if its block is now published."""
        self._writing.discard(write.slot)
        live = not write.cancelled and self.pending.get(write.key) is write
        if live:
            del self.pending[write.key]
            if ok:
                return True
            del self.index[write.key]
            self.owners.pop(write.key, None)
            self._owner[write.slot] = None  # failed: not published, the slot is reused
            self._limbo.add(write.slot)
        self._release_if_idle(write.slot)
        return False

    def pin(self, key: bytes) -> int | None:
        """Pin ``key``'s published slot for a read (and mark it recently used); None if not published."""
        slot = self.index.get(key)
        if slot is None or key in self.pending:
            return None
        self.index.move_to_end(key)
        self._pins[slot] += 1
        return slot

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        self._release_if_idle(slot)

    def drop(self, key: bytes, slot: int | None = None) -> bool:
        """Forget ``key`` (only if it is in ``slot``, when given); True if it was held.

        A write in flight for it finishes but is not published; the slot waits in
        limbo until no read or write holds it.
        """
        held = self.index.get(key)
        if held is None or slot not in (None, held):
            return False
        del self.index[key]
        self.owners.pop(key, None)
        write = self.pending.pop(key, None)
        if write is not None:
            write.cancelled = True
        self._owner[held] = None
        self._limbo.add(held)
        self._release_if_idle(held)
        return True

    def _release_if_idle(self, slot: int) -> None:
        if slot in self._limbo and self._pins[slot] == 0 and slot not in self._writing:
            self._limbo.discard(slot)
            self._free.append(slot)

    # -- invariants ------------------------------------------------------------
    def check(self) -> None:
        """Every slot is in exactly one state, owners and pins agree; AssertionError if not."""
        groups = {
            "ready": [slot for key, slot in self.index.items() if key not in self.pending],
            "pending": [w.slot for w in self.pending.values()],
            "limbo": list(self._limbo),
            "free": list(self._free),
        }
        seen: dict[int, str] = {}
        for name, slots in groups.items():
            for slot in slots:
                if slot in seen:
                    raise AssertionError(f"disk slot {slot} is both {seen[slot]} and {name}")
                seen[slot] = name
        if len(seen) != self.num_slots:
            counts = {name: len(slots) for name, slots in groups.items()}
            raise AssertionError(f"disk slots {counts} do not add up to {self.num_slots}")
        for key, slot in self.index.items():
            if self._owner[slot] != key:
                raise AssertionError(f"disk slot {slot} is indexed as {key.hex()} but owned by another key")
        for key, write in self.pending.items():
            if self.index.get(key) != write.slot or write.slot not in self._writing:
                raise AssertionError(
                    f"disk slot {write.slot} is pending for {key.hex()} but not being written"
                )
        for slot in self._free:
            if self._owner[slot] is not None or self._pins[slot] or slot in self._writing:
                raise AssertionError(f"free disk slot {slot} is owned, pinned or being written")
        stray = set(self.owners) - set(self.index)
        if stray:
            raise AssertionError(
                f"{len(stray)} disk owners belong to no held key, e.g. {next(iter(stray)).hex()}"
            )
        if any(pins < 0 for pins in self._pins):
            raise AssertionError(f"negative pin count: {self._pins}")
