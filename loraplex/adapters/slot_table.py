"""Bookkeeping of the resident adapters: occupancy, per-request pins, LRU, draining.

A *slot* is one resident adapter's handle (the index tokens carry in ``LoRAMetadata``);
its weights live in pages of the adapter page pool (``page_pool.py``), which the
adapter manager records per slot. No tensors here. With a cap (``max_loras``) the
table holds at most that many slots; without one it grows as adapters become resident
and memory, not this table, bounds them. Each slot is in one state:

==========  ==================  ========  ===============================================
state       key (adapter id)    pins      how it leaves the state
==========  ==================  ========  ===============================================
free        none                0         ``assign`` (after ``choose_slot``)
live        findable by key     >= 0      evicted by ``choose_slot`` when pins == 0 (LRU),
                                          or ``detach`` (adapter removed)
draining    not findable        > 0       last ``unpin`` frees it
==========  ==================  ========  ===============================================

A pin belongs to one request: a slot used by three running requests has three pins,
and a request holds at most one pin. Only live slots with no pins can be evicted,
least recently used first; a slot counts as used when it is pinned or unpinned.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import NamedTuple

from loraplex.adapters.errors import NoFreeSlotError


class Unpinned(NamedTuple):
    """Result of ``SlotTable.unpin``: the slot, and whether it became free."""

    slot_idx: int
    freed: bool


class SlotTable:
    """Which adapter each slot holds, and who is using it.

    ``num_slots``: the cap (``max_loras``), or None for a table that grows on demand.
    """

    def __init__(self, num_slots: int | None) -> None:
        if num_slots is not None and num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.max_slots = num_slots
        initial = num_slots or 0
        self._slot_key: list[int | None] = [None] * initial  # live or draining occupant
        self._draining: set[int] = set()
        self._key_slot: dict[int, int] = {}  # live occupants only
        self._pins: dict[str, int] = {}  # request id -> slot
        self._pin_counts: list[int] = [0] * initial
        self._lru: OrderedDict[int, None] = OrderedDict()  # live slots, least recently used first
        self._free: list[int] = list(range(initial))  # a heap: the lowest free slot first

    @property
    def num_slots(self) -> int:
        """Slots that exist now (the cap when there is one)."""
        return len(self._slot_key)

    # -- queries -----------------------------------------------------------------------

    def slot_of(self, key: int) -> int | None:
        """The live slot holding ``key``, or None."""
        return self._key_slot.get(key)

    def key_of(self, slot_idx: int) -> int | None:
        """The adapter in ``slot_idx`` (live or draining), or None if free."""
        return self._slot_key[slot_idx]

    def is_draining(self, slot_idx: int) -> bool:
        return slot_idx in self._draining

    def pin_count(self, slot_idx: int) -> int:
        return self._pin_counts[slot_idx]

    def pinned_keys(self) -> dict[str, int]:
        """Each pin holder and the adapter in the slot it pins (live or draining)."""
        return {req: self._slot_key[slot] for req, slot in self._pins.items()}  # type: ignore[misc]

    def slot_of_request(self, request_id: str) -> int | None:
        """The slot ``request_id`` holds a pin on, or None."""
        return self._pins.get(request_id)

    @property
    def num_free(self) -> int:
        """Free slots that exist now (an uncapped table also grows new ones)."""
        return len(self._free)

    @property
    def num_live(self) -> int:
        """Slots holding a findable adapter."""
        return len(self._key_slot)

    @property
    def num_pinned(self) -> int:
        return sum(count > 0 for count in self._pin_counts)

    def has_room(self) -> bool:
        """Whether ``new_slot`` would succeed without evicting."""
        return bool(self._free) or self.max_slots is None

    def eviction_order(self) -> list[int]:
        """Slots that ``choose_slot`` could evict, first candidate first."""
        return [s for s in self._lru if self._pin_counts[s] == 0]

    def lru_order(self) -> list[int]:
        """Live slots, least recently used first (pinned ones too)."""
        return list(self._lru)

    def can_place(self) -> bool:
        """Whether a new adapter could get a slot now (a free one or an evictable one)."""
        return self.has_room() or bool(self.eviction_order())

    def slots_in_use(self) -> list[int]:
        """Live and draining slots."""
        return [i for i, key in enumerate(self._slot_key) if key is not None]

    # -- transitions -------------------------------------------------------------------

    def new_slot(self) -> int | None:
        """The lowest free slot (an uncapped table grows one), or None when there is none."""
        if self._free:
            return heapq.heappop(self._free)
        if self.max_slots is None:
            self._slot_key.append(None)
            self._pin_counts.append(0)
            return len(self._slot_key) - 1
        return None

    def evict(self, slot_idx: int) -> int:
        """Free live, unpinned ``slot_idx``; returns the adapter it held."""
        key = self._slot_key[slot_idx]
        assert key is not None and slot_idx in self._lru, f"evict of slot {slot_idx}, which is not live"
        assert self._pin_counts[slot_idx] == 0, f"evict of pinned slot {slot_idx}"
        del self._key_slot[key]
        del self._lru[slot_idx]
        self._release(slot_idx)
        return key

    def choose_slot(self) -> tuple[int, int | None]:
        """Pick a slot for a new adapter: the lowest free one, else the LRU unpinned live one.

        Returns ``(slot_idx, evicted_key)``; the slot is taken (not free) when this returns:
        ``assign`` it next. Raises ``NoFreeSlotError`` when every slot is pinned or draining.
        """
        slot_idx = self.new_slot()
        if slot_idx is not None:
            return slot_idx, None
        candidates = self.eviction_order()
        if not candidates:
            raise NoFreeSlotError(
                f"all {self.num_slots} adapter slots are in use by running requests; "
                "wait for one to finish or raise max_loras"
            )
        evicted = self.evict(candidates[0])
        slot_idx = self.new_slot()
        assert slot_idx == candidates[0]
        return slot_idx, evicted

    def assign(self, slot_idx: int, key: int) -> None:
        """Make free ``slot_idx`` the live home of ``key``."""
        assert self._slot_key[slot_idx] is None, f"slot {slot_idx} holds {self._slot_key[slot_idx]}"
        assert slot_idx not in self._free, f"slot {slot_idx} was not taken (new_slot / choose_slot)"
        assert key not in self._key_slot, f"adapter {key} already lives in slot {self._key_slot[key]}"
        self._slot_key[slot_idx] = key
        self._key_slot[key] = slot_idx
        self._lru[slot_idx] = None

    def pin(self, slot_idx: int, request_id: str) -> None:
        """Record that ``request_id`` runs on live ``slot_idx``."""
        assert slot_idx in self._lru, f"pin on slot {slot_idx}, which is not live"
        held = self._pins.get(request_id)
        if held is not None:
            raise ValueError(f"request {request_id!r} already holds adapter slot {held}")
        self._pins[request_id] = slot_idx
        self._pin_counts[slot_idx] += 1
        self._lru.move_to_end(slot_idx)

    def unpin(self, request_id: str) -> Unpinned | None:
        """Drop ``request_id``'s pin (None if it holds none); a draining slot frees at zero pins."""
        slot_idx = self._pins.pop(request_id, None)
        if slot_idx is None:
            return None
        self._pin_counts[slot_idx] -= 1
        if slot_idx in self._draining:
            if self._pin_counts[slot_idx] == 0:
                self._draining.discard(slot_idx)
                self._release(slot_idx)
                return Unpinned(slot_idx, True)
        else:
            self._lru.move_to_end(slot_idx)
        return Unpinned(slot_idx, False)

    def detach(self, key: int) -> Unpinned | None:
        """Remove ``key``: its slot frees now if unpinned, else drains until its last unpin."""
        slot_idx = self._key_slot.pop(key, None)
        if slot_idx is None:
            return None
        del self._lru[slot_idx]
        if self._pin_counts[slot_idx] == 0:
            self._release(slot_idx)
            return Unpinned(slot_idx, True)
        self._draining.add(slot_idx)
        return Unpinned(slot_idx, False)

    def _release(self, slot_idx: int) -> None:
        self._slot_key[slot_idx] = None
        heapq.heappush(self._free, slot_idx)

    # -- invariants --------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (works under ``python -O``)."""
        errors: list[str] = []
        counts = [0] * self.num_slots
        if self.max_slots is not None and self.num_slots != self.max_slots:
            errors.append(f"a capped table has {self.num_slots} slots, not {self.max_slots}")
        empty = sorted(i for i, key in enumerate(self._slot_key) if key is None)
        if sorted(self._free) != empty:
            errors.append(f"free list {sorted(self._free)} != empty slots {empty}")
        for request_id, slot_idx in self._pins.items():
            counts[slot_idx] += 1
            if self._slot_key[slot_idx] is None:
                errors.append(f"request {request_id!r} pins free slot {slot_idx}")
        if counts != self._pin_counts:
            errors.append(f"pin counts {self._pin_counts} != pins per slot {counts}")
        for slot_idx, key in enumerate(self._slot_key):
            live = key is not None and self._key_slot.get(key) == slot_idx
            if key is None and (slot_idx in self._lru or slot_idx in self._draining):
                errors.append(f"free slot {slot_idx} is in the LRU or draining")
            if key is not None and live == (slot_idx in self._draining):
                errors.append(f"slot {slot_idx} (adapter {key}) is neither live nor draining, or both")
            if live and slot_idx not in self._lru:
                errors.append(f"live slot {slot_idx} is missing from the LRU")
            if slot_idx in self._draining and self._pin_counts[slot_idx] == 0:
                errors.append(f"draining slot {slot_idx} has no pins (leaked)")
        for key, slot_idx in self._key_slot.items():
            if self._slot_key[slot_idx] != key:
                errors.append(
                    f"adapter {key} maps to slot {slot_idx}, which holds {self._slot_key[slot_idx]}"
                )
        if errors:
            raise AssertionError("slot table inconsistent: " + "; ".join(errors))
