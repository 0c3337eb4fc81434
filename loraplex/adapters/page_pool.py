"""The adapter page pool: resident adapters' weights in rank-granular pages, bounded by memory.

S-LoRA's point (Sheng et al., MLSys 2024) is that the number of adapters one step may
serve should be bounded by memory, not by a slot count, and that an adapter of rank r
should cost r rows, not ``max_lora_rank``. Here a *page* holds ``page_rank`` (P) rank
rows of one projection group (``spec.GROUPS``: qkv, o, gate_up, down) in every layer, in
the LoRA backend's weight layout. Each group has its own pool (``group_pool.py``), so::

    pool[group][layer] = layout.allocate(num_slices, capacity, P, in_features, max_out)

and the kernels see a page exactly as they saw a rank-P adapter slot before: an adapter
whose qkv modules have rank 16 holds two qkv pages (``page_table.py``), and its delta is
the sum of the two pages' deltas (LoRA is a sum over rank rows), which the backends
compute in one call (``LoRABackend.apply_paged``). An adapter takes pages only in the
groups it targets: a q/v adapter costs no o, gate/up or down memory.

Memory: every group's per-layer tensors are laid out in an *arena* (``page_arena.py``;
where each tensor lies: ``page_placement.py``): in an engine, blocks borrowed from the top
of the KV cache's pool, so adapter pages and KV blocks share one memory pool; on its own,
memory bounded by ``lora_memory``. A group pool starts empty and grows between steps (the
layout is recomputed and the pages in use are copied over: ``_relayout``); what fits is
what the arena can hold now (``PageArena.max_blocks``: its cap, ``lora_memory``, and, in an
engine, the KV blocks that are free). Free pages are reused by their group; when the bytes
are needed elsewhere, the group is *compacted* (pages in use move down, the pool shrinks)
and the adapters' page tables follow the moves; ``shrink`` gives every free page's bytes
back to the arena (the engine does before it would preempt a sequence for KV).

This module owns ``LoRAPagePool``, every group's pool as one: its sizes and what fits, page
allocation (growth, compaction, ``shrink``, the re-layout), the kernels' view of a group in
a layer, and the invariants (``check``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from loraplex.adapters.group_pool import GroupPool
from loraplex.adapters.page_arena import PageArena
from loraplex.adapters.page_placement import Placement, check_placement, place, views
from loraplex.adapters.page_table import PageTable, Remaps
from loraplex.adapters.peft_weights import AdapterWeights
from loraplex.adapters.slot_buffers import SlotBuffers
from loraplex.adapters.spec import GROUPS, BaseModelSpec, GroupName
from loraplex.kernels.lora_layout import LOGICAL_LAYOUT, LoRAWeightLayout

MIN_GROWTH_PAGES = 8
"""Smallest growth step of a group pool: growing re-lays the whole arena, so not page by page."""


class LoRAPagePool:
    """Every group's page pool, laid out in one arena (see the module doc)."""

    def __init__(
        self,
        spec: BaseModelSpec,
        page_rank: int,
        arena: PageArena,
        device: torch.device,
        dtype: torch.dtype,
        *,
        layout: LoRAWeightLayout = LOGICAL_LAYOUT,
    ) -> None:
        if page_rank < 1:
            raise ValueError(f"page_rank must be >= 1, got {page_rank}")
        if arena.num_layers != spec.num_layers:
            raise ValueError(f"an arena of {arena.num_layers} layers for a model of {spec.num_layers}")
        self.spec = spec
        self.page_rank = page_rank
        self.arena = arena
        self.device = device
        self.dtype = dtype
        self.layout = layout
        self._groups = {g: GroupPool(spec, g, page_rank, layout, dtype, device) for g in GROUPS}
        self._placement = Placement()
        self._placements: dict[tuple[tuple[GroupName, int], ...], Placement] = {}  # memo of _place
        self._generation = 0
        largest = max(self._groups, key=lambda g: self._groups[g].page_nbytes)
        if self.blocks_for({largest: 1}) > arena.cap_blocks:
            raise ValueError(
                f"the adapter page budget ({self.budget_bytes} bytes) holds no page: one page of rank "
                f"{page_rank} takes up to {self._groups[largest].page_nbytes} bytes; raise lora_memory"
            )

    # -- sizes ---------------------------------------------------------------------------

    def page_nbytes(self, group: GroupName) -> int:
        """Bytes of one page of ``group`` (every layer, A and B, in the layout)."""
        return self._groups[group].page_nbytes

    def _arena_nbytes(self, num_blocks: int) -> int:
        return num_blocks * self.arena.block_nbytes * self.arena.num_chunks * self.arena.num_layers

    @property
    def budget_bytes(self) -> int:
        """The most bytes the pool may ever hold (the arena's cap: ``lora_memory``)."""
        return self._arena_nbytes(self.arena.cap_blocks)

    @property
    def nbytes(self) -> int:
        """Bytes the arena holds now (pages used and free, and the layout's slack)."""
        return self._arena_nbytes(self.arena.num_blocks)

    @property
    def used_nbytes(self) -> int:
        """Bytes of pages adapters hold."""
        return sum(p.num_used * p.page_nbytes for p in self._groups.values())

    def capacity(self, group: GroupName) -> int:
        return self._groups[group].capacity

    def num_free(self, group: GroupName) -> int:
        return len(self._groups[group].free)

    def num_used(self, group: GroupName) -> int:
        return self._groups[group].num_used

    @property
    def generation(self) -> int:
        """Changes whenever the pool re-lays its tensors (they are new objects then)."""
        return self._generation

    def need_nbytes(self, need: Mapping[GroupName, int]) -> int:
        return sum(n * self._groups[g].page_nbytes for g, n in need.items())

    # -- layout in the arena ---------------------------------------------------------------

    def _place(self, capacities: Mapping[GroupName, int]) -> Placement:
        """Every group's A and B per layer in the arena's chunks (``page_placement.place``),
        memoized by capacities; the arena needs ``num_blocks`` blocks."""
        key = tuple(sorted((g, c) for g, c in capacities.items() if c > 0))
        placement = self._placements.get(key)
        if placement is not None:
            return placement
        placement = place(key, self._groups, self.arena.num_chunks, self.arena.block_nbytes)
        if len(self._placements) > 4096:
            self._placements.clear()
        self._placements[key] = placement
        return placement

    def blocks_for(self, capacities: Mapping[GroupName, int]) -> int:
        """Arena blocks the groups need at ``capacities`` pages (groups left out: none)."""
        return self._place(capacities).num_blocks

    def can_ever_fit(self, need: Mapping[GroupName, int]) -> bool:
        """Whether ``need`` alone fits the arena's cap (else no eviction ever makes room)."""
        return self.blocks_for(need) <= self.arena.cap_blocks

    def fits(
        self,
        need: Mapping[GroupName, int],
        freed: Mapping[GroupName, int] | None = None,
        keep_free_blocks: int = 0,
    ) -> bool:
        """Whether ``need`` fits beside the pages in use (less ``freed`` pages about to be freed),
        compacting every group if need be, in what the arena could hold now while leaving
        ``keep_free_blocks`` of the pool it borrows from free."""
        freed = freed or {}
        tight = {g: p.num_used - freed.get(g, 0) + need.get(g, 0) for g, p in self._groups.items()}
        return self.blocks_for(tight) <= self.arena.max_blocks(keep_free_blocks)

    # -- allocation ----------------------------------------------------------------------

    def allocate(self, need: Mapping[GroupName, int], keep_free_blocks: int = 0) -> tuple[PageTable, Remaps]:
        """Pages for ``need``, re-laying the arena if they are not free; raises if they do not fit.

        Returns the pages and, per group, the pages that compaction moved (``{old: new}``),
        which the caller applies to the page tables of the adapters it holds.
        """
        if not self.fits(need, keep_free_blocks=keep_free_blocks):
            raise MemoryError(f"adapter pages {dict(need)} do not fit in {self.budget_bytes} bytes")
        moved: Remaps = {}
        if any(len(self._groups[g].free) < n for g, n in need.items()):
            used = {g: p.num_used + need.get(g, 0) for g, p in self._groups.items()}
            keep = {g: max(p.capacity, used[g]) for g, p in self._groups.items()}
            # Grow by half (fewer re-layouts) where room allows; else exactly; else compact.
            grown = {
                g: max(used[g], p.capacity + max(MIN_GROWTH_PAGES, p.capacity // 2))
                if used[g] > p.capacity
                else keep[g]
                for g, p in self._groups.items()
            }
            limit = self.arena.max_blocks(keep_free_blocks)
            capacities = next(c for c in (grown, keep, used) if self.blocks_for(c) <= limit)
            moved = self._relayout(capacities)
        pages = {group: self._groups[group].take(n) for group, n in need.items() if n > 0}
        return pages, moved

    def shrink(self) -> Remaps:
        """Give every free page's bytes back to the arena (compacting each group); the moves."""
        tight = {g: p.num_used for g, p in self._groups.items()}
        if self.blocks_for(tight) >= self.arena.num_blocks:
            return {}
        return self._relayout(tight)

    def _relayout(self, capacities: Mapping[GroupName, int]) -> Remaps:
        """Lay every group out anew at ``capacities`` pages, resizing the arena: the pages in
        use are copied over (moved down where a group shrinks below them)."""
        moved = {
            g: remap
            for g, p in self._groups.items()
            if capacities[g] < p.capacity and (remap := p.compaction(capacities[g]))
        }
        # The arena's chunks move when it resizes (the KV arena grows downwards), so the old
        # tensors are copied out first.
        for pool in self._groups.values():
            pool.layers = [(a.clone(), b.clone()) for a, b in pool.layers]
        placement = self._place(capacities)
        self.arena.resize(placement.num_blocks)
        for group, pool in self._groups.items():
            capacity = capacities[group]
            pool.install(views(self.arena, pool, capacity, placement), capacity, moved.get(group, {}))
        self._placement = placement
        self._generation += 1
        return moved

    def write(self, pages: PageTable, weights: AdapterWeights) -> None:
        """Store ``weights`` in ``pages`` (from ``allocate``) and mark them in use."""
        for group, group_pages in pages.items():
            self._groups[group].write(group_pages, weights)

    def free(self, pages: PageTable) -> None:
        """Give ``pages`` back (scale 0 at once; the rows stay until the page is reused)."""
        for group, group_pages in pages.items():
            self._groups[group].give_back(group_pages)

    # -- the kernels' view ---------------------------------------------------------------

    def get(self, layer_idx: int, group: GroupName) -> SlotBuffers:
        """``group``'s pages in layer ``layer_idx``: the slot dimension indexes pages, rank P."""
        pool = self._groups[group]
        lora_a, lora_b = pool.layers[layer_idx]
        return SlotBuffers(lora_a, lora_b, pool.scales, pool.sizes)

    def get_logical(self, layer_idx: int, group: GroupName) -> SlotBuffers:
        """The same in the logical layout (a copy where the layout needs one)."""
        buf = self.get(layer_idx, group)
        lora_a, lora_b = self.layout.logical(buf.lora_a, buf.lora_b)
        return SlotBuffers(lora_a, lora_b, buf.scales, buf.slice_sizes)

    # -- invariants ----------------------------------------------------------------------

    def check(self, owners: Mapping[int, PageTable]) -> list[str]:
        """Errors: pages not owned by exactly one holder, or free/used scales and counts off."""
        errors: list[str] = list(self.arena.check())
        if self.arena.num_blocks > self.arena.cap_blocks:
            errors.append(f"the arena holds {self.arena.num_blocks} blocks > cap {self.arena.cap_blocks}")
        errors += self._check_placement()
        for group, pool in self._groups.items():
            owner_of: dict[int, int] = {}
            for holder, table in owners.items():
                for page in table.get(group, []):
                    if page in owner_of:
                        errors.append(f"{group} page {page} held by {owner_of[page]} and {holder}")
                    owner_of[page] = holder
            free = set(pool.free)
            if len(free) != len(pool.free):
                errors.append(f"{group}: a page is on the free list twice")
            if free & owner_of.keys():
                errors.append(f"{group}: pages {sorted(free & owner_of.keys())} are free and held")
            if len(free) + len(owner_of) != pool.capacity:
                errors.append(
                    f"{group}: {len(owner_of)} held + {len(free)} free != {pool.capacity} pages in the pool"
                )
            scales = pool.scales.tolist()
            if any(scales[p] != 0.0 for p in free):
                errors.append(f"{group}: a free page has a non-zero scale")
            if any(scales[p] != 1.0 for p in owner_of):
                errors.append(f"{group}: a held page has scale != 1")
        return errors

    def _check_placement(self) -> list[str]:
        """Every group's tensors lie inside the arena's chunks, in their places, apart."""
        placement = self._place({g: p.capacity for g, p in self._groups.items()})
        if placement != self._placement:
            return ["the pools' capacities do not match the arena's layout"]
        return check_placement(self.arena, placement, self._groups, self.spec.num_layers)

    def groups(self) -> Iterator[GroupName]:
        return iter(self._groups)
