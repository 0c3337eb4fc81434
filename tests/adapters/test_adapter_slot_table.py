"""Slot bookkeeping: exact slot ids, LRU eviction order, per-request pins, draining."""

from __future__ import annotations

import random

import pytest

from loraplex.adapters import NoFreeSlotError
from loraplex.adapters.slot_table import SlotTable, Unpinned


def _load(table: SlotTable, key: int) -> tuple[int, int | None]:
    slot_idx, evicted = table.choose_slot()
    table.assign(slot_idx, key)
    return slot_idx, evicted


def test_free_slots_fill_lowest_first_then_lru_evicts() -> None:
    table = SlotTable(3)
    assert [_load(table, k) for k in (10, 11, 12)] == [(0, None), (1, None), (2, None)]
    # Use order: 11, 10, 12 (pin + unpin each) -> LRU is 11, 10, 12.
    for key, req in ((11, "a"), (10, "b"), (12, "c")):
        table.pin(table.slot_of(key), req)  # type: ignore[arg-type]
        table.unpin(req)
    assert table.eviction_order() == [1, 0, 2]
    assert _load(table, 13) == (1, 11)
    assert table.slot_of(11) is None and table.slot_of(13) == 1
    assert _load(table, 14) == (0, 10)
    assert _load(table, 15) == (2, 12)
    table.check_integrity()


def test_pinned_slots_are_never_evicted() -> None:
    table = SlotTable(2)
    _load(table, 1)
    _load(table, 2)
    table.pin(0, "r1")
    assert table.eviction_order() == [1]
    assert _load(table, 3) == (1, 2)
    table.pin(1, "r3")
    assert not table.can_place()
    with pytest.raises(NoFreeSlotError, match="all 2 adapter slots"):
        table.choose_slot()
    table.unpin("r1")
    assert table.can_place() and table.eviction_order() == [0]
    table.check_integrity()


def test_pins_are_counted_per_request() -> None:
    table = SlotTable(2)
    slot_idx, _ = _load(table, 7)
    for req in ("a", "b", "c"):
        table.pin(slot_idx, req)
    assert table.pin_count(slot_idx) == 3 and table.num_pinned == 1
    with pytest.raises(ValueError, match="already holds"):
        table.pin(slot_idx, "a")
    assert table.unpin("b") == Unpinned(slot_idx, False)
    assert table.unpin("b") is None  # double release is harmless
    assert table.pin_count(slot_idx) == 2
    table.unpin("a")
    table.unpin("c")
    assert table.pin_count(slot_idx) == 0 and table.num_pinned == 0
    table.check_integrity()


def test_detach_frees_unpinned_and_drains_pinned() -> None:
    table = SlotTable(2)
    _load(table, 1)
    _load(table, 2)
    assert table.detach(1) == Unpinned(0, True)
    assert table.key_of(0) is None and table.num_free == 1
    table.pin(1, "x")
    table.pin(1, "y")
    assert table.detach(2) == Unpinned(1, False)
    assert table.slot_of(2) is None and table.is_draining(1) and table.key_of(1) == 2
    assert table.eviction_order() == []  # a draining slot is not evictable
    assert _load(table, 3) == (0, None)
    table.pin(0, "z")
    assert not table.can_place()
    assert table.unpin("x") == Unpinned(1, False)
    assert table.unpin("y") == Unpinned(1, True)
    assert table.key_of(1) is None and table.num_free == 1
    assert table.detach(99) is None
    table.unpin("z")
    table.check_integrity()


def test_random_workload_never_leaks() -> None:
    rng = random.Random(0)
    table = SlotTable(3)
    running: dict[str, int] = {}
    for step in range(2000):
        action = rng.random()
        if action < 0.5 and len(running) < 8:
            key = rng.randrange(6)
            slot_idx = table.slot_of(key)
            if slot_idx is None:
                if not table.can_place():
                    continue
                slot_idx, _ = _load(table, key)
            req = f"r{step}"
            table.pin(slot_idx, req)
            running[req] = slot_idx
        elif action < 0.9 and running:
            req = rng.choice(sorted(running))
            assert table.unpin(req) is not None
            del running[req]
        else:
            table.detach(rng.randrange(6))
        table.check_integrity()
    for req in list(running):
        table.unpin(req)
    table.check_integrity()
    assert table.num_pinned == 0
    assert all(not table.is_draining(s) for s in range(3))


def test_integrity_check_catches_corruption() -> None:
    table = SlotTable(2)
    _load(table, 1)
    table.pin(0, "r")
    table._pin_counts[0] = 5  # simulate a bookkeeping bug
    with pytest.raises(AssertionError, match="pin counts"):
        table.check_integrity()
