"""The device tier: which adapters are resident, their slots, and their pages in the pool.

A resident adapter has a slot (``slot_table.py``: the handle tokens carry, its pins and
its place in the LRU order) and a page table (``page_table.py``: its pages per projection
group). Making an adapter resident evicts least recently used unpinned adapters until a
slot and its pages fit; ``give_back_memory`` evicts them to hand arena blocks back to the
KV cache. Pages that a compaction moves are followed in every page table here, so the
tables stay the one record the kernels read.

Not thread-safe: the ``AdapterManager`` calls it under its lock.
"""

from __future__ import annotations

import logging

import torch

from loraplex.adapters.errors import NoFreeSlotError
from loraplex.adapters.page_arena import PageArena
from loraplex.adapters.page_pool import LoRAPagePool
from loraplex.adapters.page_table import PageTable, Remaps, pages_needed
from loraplex.adapters.peft_weights import AdapterWeights
from loraplex.adapters.slot_table import SlotTable
from loraplex.adapters.spec import BaseModelSpec, GroupName
from loraplex.kernels.lora_layout import LoRAWeightLayout

logger = logging.getLogger(__name__)

PagesNeeded = dict[GroupName, int]
"""Pages an adapter needs per group it targets."""


class DeviceResidency:
    """Slots and page tables of the resident adapters, over one page pool."""

    def __init__(
        self,
        spec: BaseModelSpec,
        max_loras: int | None,
        page_rank: int,
        arena: PageArena,
        device: torch.device,
        dtype: torch.dtype,
        layout: LoRAWeightLayout,
    ) -> None:
        self.slots = SlotTable(max_loras)
        self.pool = LoRAPagePool(spec, page_rank, arena, device, dtype, layout=layout)
        self._pages: dict[int, PageTable] = {}  # slot -> its adapter's pages
        self._need: dict[str, PagesNeeded] = {}  # version -> pages per group (cached)
        self.num_slot_loads = 0
        """Adapters written into device pages since start-up."""
        self.num_evictions = 0
        """Resident adapters evicted to make room since start-up."""

    # -- reading ------------------------------------------------------------------------

    def slot_of(self, adapter_id: int) -> int | None:
        """The slot of resident ``adapter_id``, or None."""
        return self.slots.slot_of(adapter_id)

    def pages_needed(self, version: str, weights: AdapterWeights) -> PagesNeeded:
        """Pages the adapter version needs per group (computed once per version)."""
        need = self._need.get(version)
        if need is None:
            need = self._need[version] = pages_needed(weights, self.pool.page_rank)
        return need

    def forget(self, version: str) -> None:
        """Drop what is cached of a version no registered adapter has any more."""
        self._need.pop(version, None)

    def page_tables(self) -> dict[int, PageTable]:
        """A copy of each resident (or draining) slot's pages per group."""
        return {slot: {g: list(p) for g, p in table.items()} for slot, table in self._pages.items()}

    def pages_of(self, adapter_id: int) -> PageTable | None:
        """A copy of resident ``adapter_id``'s pages per group, or None."""
        slot_idx = self.slots.slot_of(adapter_id)
        return None if slot_idx is None else {g: list(p) for g, p in self._pages[slot_idx].items()}

    def held_nbytes(self, slot_idx: int) -> int:
        """Bytes of the pages the slot's adapter holds."""
        return self.pool.need_nbytes({g: len(p) for g, p in self._pages[slot_idx].items()})

    def could_make_room(self, need: PagesNeeded, keep_free_blocks: int = 0) -> bool:
        """Whether a slot and ``need`` pages could be had now, evicting unpinned adapters if need be."""
        evictable = self.slots.eviction_order()
        if not self.slots.has_room() and not evictable:
            return False
        freeable: dict[GroupName, int] = {}
        for slot_idx in evictable:
            for group, pages in self._pages[slot_idx].items():
                freeable[group] = freeable.get(group, 0) + len(pages)
        return self.pool.fits(need, freed=freeable, keep_free_blocks=keep_free_blocks)

    def could_ever_fit_beside(self, need: PagesNeeded, kv_blocks: int) -> bool:
        """Whether ``need`` pages fit the arena beside ``kv_blocks`` of KV, every adapter evicted."""
        return self.pool.blocks_for(need) <= self.pool.arena.max_blocks_beside(kv_blocks)

    # -- moving -------------------------------------------------------------------------

    def load(
        self, adapter_id: int, weights: AdapterWeights, need: PagesNeeded, keep_free_blocks: int = 0
    ) -> int:
        """Make ``adapter_id`` resident with ``weights``: room, pages, a slot; return the slot.

        Evicts least recently used unpinned adapters as needed; raises ``NoFreeSlotError``
        (nothing evicted) when what is evictable does not make room. ``keep_free_blocks``:
        arena blocks the load must leave free (the KV a request is about to take).
        """
        evicted = self._make_room(adapter_id, need, keep_free_blocks)
        pages, moved = self.pool.allocate(need, keep_free_blocks)
        self._follow(moved)
        self.pool.write(pages, weights)
        slot_idx = self.slots.new_slot()
        assert slot_idx is not None, "make_room left no slot"
        self.slots.assign(slot_idx, adapter_id)
        self._pages[slot_idx] = pages
        self.num_slot_loads += 1
        logger.debug("loaded adapter %d: slot %d, pages %s", adapter_id, slot_idx, pages)
        if evicted:
            logger.debug("evicted adapters %s for adapter %d", evicted, adapter_id)
        return slot_idx

    def free_pages(self, slot_idx: int) -> None:
        """Give the slot's pages back to the pool (its adapter left the device)."""
        self.pool.free(self._pages.pop(slot_idx))

    def give_back_memory(self, num_blocks: int) -> int:
        """Return arena blocks to the KV cache, evicting unpinned adapters (least recently
        used first) until ``num_blocks`` came back or nothing more can; how many came back."""
        before = self.pool.arena.num_blocks
        target = max(0, before - num_blocks)
        order = self.slots.eviction_order()
        used = {g: self.pool.num_used(g) for g in self.pool.groups()}
        for slot_idx in order:
            for group, pages in self._pages[slot_idx].items():
                used[group] -= len(pages)
        # All or nothing: a partial return would cost reloads (and a re-layout of the
        # arena) and still leave the sequence without its blocks.
        if self.pool.blocks_for(used) > target:
            return 0
        for slot_idx in order:
            tight = {g: self.pool.num_used(g) for g in self.pool.groups()}
            if self.pool.blocks_for(tight) <= target:
                break  # free pages (growth slack) and the adapters evicted so far suffice
            self._evict(slot_idx)
        self._follow(self.pool.shrink())
        return before - self.pool.arena.num_blocks

    def check(self) -> list[str]:
        """What is wrong between the slots, the page tables and the pool (empty: nothing)."""
        errors: list[str] = []
        in_use = self.slots.slots_in_use()
        if sorted(self._pages) != in_use:
            errors.append(f"slots with pages {sorted(self._pages)} != slots in use {in_use}")
        return errors + self.pool.check(self._pages)

    # -- internals ----------------------------------------------------------------------

    def _evict(self, slot_idx: int) -> int:
        adapter_id = self.slots.evict(slot_idx)
        self.free_pages(slot_idx)
        self.num_evictions += 1
        return adapter_id

    def _follow(self, moved: Remaps) -> None:
        """Point the page tables at the pages a compaction moved."""
        for group, remap in moved.items():
            for table in self._pages.values():
                if group in table:
                    table[group] = [remap.get(p, p) for p in table[group]]

    def _make_room(self, adapter_id: int, need: PagesNeeded, keep_free_blocks: int) -> list[int]:
        """Evict least recently used unpinned adapters until a slot and ``need`` pages are free.

        Pages of any group count (the pool compacts groups to move bytes between them), so
        eviction simply follows the LRU order. Raises ``NoFreeSlotError`` when what is
        evictable does not suffice (nothing is evicted then).
        """
        if not self.could_make_room(need, keep_free_blocks):
            raise NoFreeSlotError(
                f"adapter {adapter_id}: its pages ({need} of rank {self.pool.page_rank}) do not fit "
                f"the adapter memory now ({self.pool.arena.max_blocks()} blocks: lora_memory "
                f"{self.pool.budget_bytes} bytes at most, within the free KV blocks) beside the "
                "adapters running requests use; retry when one finishes"
            )
        evicted: list[int] = []
        for slot_idx in self.slots.eviction_order():
            if self.pool.fits(need, keep_free_blocks=keep_free_blocks) and self.slots.has_room():
                break
            evicted.append(self._evict(slot_idx))
        return evicted
