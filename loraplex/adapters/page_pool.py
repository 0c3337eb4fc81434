"""The adapter page pool: resident adapters' weights in rank-granular pages, bounded by memory.

S-LoRA's point (Sheng et al., MLSys 2024) is that the number of adapters one step may
serve should be bounded by memory, not by a slot count, and that an adapter of rank r
should cost r rows, not ``max_lora_rank``. Here a *page* holds ``page_rank`` (P) rank
rows of one projection group (``spec.GROUPS``: qkv, o, gate_up, down) in every layer, in
the LoRA backend's weight layout. Each group has its own pool, so::

    pool[group][layer] = layout.allocate(num_slices, capacity, P, in_features, max_out)

and the kernels see a page exactly as they saw a rank-P adapter slot before: an adapter
whose qkv modules have rank 16 holds two qkv pages, and its delta is the sum of the two
pages' deltas (LoRA is a sum over rank rows), which the backends compute in one call
(``LoRABackend.apply_paged``). An adapter takes pages only in the groups it targets:
a q/v adapter costs no o, gate/up or down memory.

Memory: every group's per-layer tensors are laid out in an *arena* (``page_arena.py``):
in an engine, blocks borrowed from the top of the KV cache's pool, so adapter pages and
KV blocks share one memory pool; on its own, memory bounded by ``lora_memory``. A group
pool starts empty and grows between steps (the layout is recomputed and the pages in use
are copied over: ``_relayout``); what fits is what the arena can hold now
(``PageArena.max_blocks``: its cap, ``lora_memory``, and, in an engine, the KV blocks that
are free). Free pages are reused by their group; when the bytes are needed elsewhere, the
group is *compacted* (pages in use move down, the pool shrinks) and the adapters' page
tables follow the moves; ``shrink`` gives every free page's bytes back to the arena (the
engine does before it would preempt a sequence for KV). ``scales[page]`` is 1.0 for an
allocated page and 0.0 for a free one, so a token that wrongly points at a free page
still gets no delta.

Writing a page touches only that page's rows, which no token in flight reads (it is
free); on CUDA the copies are ``non_blocking`` from pinned host memory on the current
stream, so they are ordered before the next forward that reads them.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from loraplex.adapters.page_arena import ALIGN, PageArena
from loraplex.adapters.peft_weights import AdapterWeights
from loraplex.adapters.slot_buffers import SlotBuffers
from loraplex.adapters.spec import GROUPS, BaseModelSpec, GroupName
from loraplex.kernels.lora_layout import LOGICAL_LAYOUT, LoRAWeightLayout

PageTable = dict[GroupName, list[int]]
"""An adapter's pages per group it targets (page ids index that group's pool)."""

Remaps = dict[GroupName, dict[int, int]]
"""Pages a compaction moved, per group: ``{old page: new page}`` (page tables must follow)."""

MIN_GROWTH_PAGES = 8
"""Smallest growth step of a group pool: growing re-lays the whole arena, so not page by page."""


def pages_needed(weights: AdapterWeights, page_rank: int) -> dict[GroupName, int]:
    """Pages an adapter needs per group: its largest rank in the group, in pages (rounded up)."""
    rank: dict[GroupName, int] = {}
    module_group = {m: g for g, modules in GROUPS.items() for m in modules}
    for (_layer, module), w in weights.modules.items():
        group = module_group[module]
        rank[group] = max(rank.get(group, 0), int(w.lora_a.shape[0]))
    return {g: -(-r // page_rank) for g, r in rank.items() if r > 0}


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class _Placement:
    """Where each group's A (0) and B (1) tensor sit in every layer: (chunk, byte offset)."""

    num_blocks: int = 0
    spots: dict[tuple[GroupName, int], tuple[int, int]] = field(default_factory=dict)


class _GroupPool:
    """One group's pages in every layer, their scales, and the free list."""

    def __init__(
        self,
        spec: BaseModelSpec,
        group: GroupName,
        page_rank: int,
        layout: LoRAWeightLayout,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.group = group
        self.num_slices = len(GROUPS[group])
        self.sizes = spec.slice_sizes(group)
        self.in_features = spec.group_in_features(group)
        self.num_layers = spec.num_layers
        self.page_rank = page_rank
        self.layout = layout
        self.dtype = dtype
        self.device = device
        elem = torch.empty((), dtype=dtype).element_size()
        a, b = self._allocate(1, torch.device("meta"))
        a2, b2 = self._allocate(2, torch.device("meta"))
        # The pool re-lays tensors by page count, so a tensor must be linear in it.
        assert (a2.numel(), b2.numel()) == (2 * a.numel(), 2 * b.numel()), layout.name
        self.a_nbytes, self.b_nbytes = a.numel() * elem, b.numel() * elem  # one page, one layer
        self.page_nbytes = (self.a_nbytes + self.b_nbytes) * self.num_layers
        self.capacity = 0
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            self._allocate(0, device) for _ in range(self.num_layers)
        ]
        self.scales = torch.zeros(0, dtype=torch.float32, device=device)
        self.free: list[int] = []  # a heap: the lowest free page first

    def _allocate(self, capacity: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layout.allocate(
            self.num_slices, capacity, self.page_rank, self.in_features, max(self.sizes), self.dtype, device
        )

    def shapes(self, capacity: int) -> tuple[torch.Size, torch.Size]:
        a, b = self._allocate(capacity, torch.device("meta"))
        return a.shape, b.shape

    @property
    def num_used(self) -> int:
        return self.capacity - len(self.free)

    def compaction(self, capacity: int) -> dict[int, int]:
        """``{old: new}`` moving the pages in use at or above ``capacity`` into free pages below it."""
        free = set(self.free)
        moved_from = [p for p in range(capacity, self.capacity) if p not in free]
        free_low = sorted(p for p in free if p < capacity)
        assert len(moved_from) <= len(free_low), f"{self.group}: {capacity} pages cannot hold those in use"
        return dict(zip(moved_from, free_low, strict=False))

    def install(
        self,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        capacity: int,
        remap: dict[int, int],
    ) -> None:
        """Move to new tensors of ``capacity`` pages: pages below both capacities keep their
        place, the pages in ``remap`` move, the rest is zero. ``self.layers`` must not alias
        ``layers`` (the caller passes copies of the old tensors when they would)."""
        a_dim, b_dim = self.layout.slot_dims
        keep = min(self.capacity, capacity)
        for (new_a, new_b), (old_a, old_b) in zip(layers, self.layers, strict=True):
            new_a.narrow(a_dim, keep, capacity - keep).zero_()
            new_b.narrow(b_dim, keep, capacity - keep).zero_()
            new_a.narrow(a_dim, 0, keep).copy_(old_a.narrow(a_dim, 0, keep))
            new_b.narrow(b_dim, 0, keep).copy_(old_b.narrow(b_dim, 0, keep))
            for src, dst in remap.items():
                new_a.narrow(a_dim, dst, 1).copy_(old_a.narrow(a_dim, src, 1))
                new_b.narrow(b_dim, dst, 1).copy_(old_b.narrow(b_dim, src, 1))
        scales = torch.zeros(capacity, dtype=torch.float32, device=self.device)
        scales[:keep] = self.scales[:keep]
        for src, dst in remap.items():
            scales[dst] = self.scales[src]
        used = {p for p in range(self.capacity) if p not in set(self.free)}
        used = {remap.get(p, p) for p in used}
        assert all(p < capacity for p in used), f"{self.group}: a page in use fell outside the pool"
        self.layers = layers
        self.scales = scales
        self.free = [p for p in range(capacity) if p not in used]
        heapq.heapify(self.free)
        self.capacity = capacity

    def take(self, n: int) -> list[int]:
        assert len(self.free) >= n, f"{self.group}: {n} pages wanted, {len(self.free)} free"
        return [heapq.heappop(self.free) for _ in range(n)]

    def give_back(self, pages: list[int]) -> None:
        for page in pages:
            self.scales[page] = 0.0
            heapq.heappush(self.free, page)

    def write(self, pages: list[int], weights: AdapterWeights) -> None:
        """Store the adapter's rows of this group in ``pages`` (page i = rank rows [iP, (i+1)P))."""
        non_blocking = self.device.type == "cuda"
        p = self.page_rank
        for layer_idx, (lora_a, lora_b) in enumerate(self.layers):
            for i, page in enumerate(pages):
                self.layout.clear_slot(lora_a, lora_b, page)
                for slice_idx, module in enumerate(GROUPS[self.group]):
                    w = weights.modules.get((layer_idx, module))
                    if w is None or w.lora_a.shape[0] <= i * p:
                        continue
                    rows = slice(i * p, (i + 1) * p)
                    self.layout.write(
                        lora_a,
                        lora_b,
                        slice_idx,
                        page,
                        w.lora_a[rows],
                        w.lora_b[:, rows],
                        non_blocking=non_blocking,
                    )
        for page in pages:
            self.scales[page] = 1.0


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
        self._groups = {g: _GroupPool(spec, g, page_rank, layout, dtype, device) for g in GROUPS}
        self._placement = _Placement()
        self._placements: dict[tuple[tuple[GroupName, int], ...], _Placement] = {}  # memo of _place
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

    def _place(self, capacities: Mapping[GroupName, int]) -> _Placement:
        """Every group's A and B per layer in the arena's chunks, the fullest chunk as empty as
        can be (at most 8 tensors: every split into two chunks is tried; more chunks: largest
        first into the emptiest); the arena needs as many blocks as the fullest chunk."""
        key = tuple(sorted((g, c) for g, c in capacities.items() if c > 0))
        placement = self._placements.get(key)
        if placement is not None:
            return placement
        items = []
        for group, capacity in key:
            pool = self._groups[group]
            items.append((_align(pool.a_nbytes * capacity), group, 0))
            items.append((_align(pool.b_nbytes * capacity), group, 1))
        items.sort(reverse=True)
        chunks = self.arena.num_chunks
        bins: list[list[tuple[int, GroupName, int]]] = [[] for _ in range(chunks)]
        if chunks == 2 and items:
            # The first item goes to chunk 0 (the two chunks are alike); bit i: item i + 1.
            best = min(
                range(1 << (len(items) - 1)),
                key=lambda mask: max(
                    sum(n for i, (n, _, _) in enumerate(items) if i and mask >> (i - 1) & 1),
                    sum(n for i, (n, _, _) in enumerate(items) if not i or not mask >> (i - 1) & 1),
                ),
            )
            for i, item in enumerate(items):
                bins[1 if i and best >> (i - 1) & 1 else 0].append(item)
        else:
            for item in items:
                min(bins, key=lambda b: sum(n for n, _, _ in b)).append(item)
        spots: dict[tuple[GroupName, int], tuple[int, int]] = {}
        for chunk, placed in enumerate(bins):
            offset = 0
            for nbytes, group, which in placed:
                spots[(group, which)] = (chunk, offset)
                offset += nbytes
        fullest = max(sum(n for n, _, _ in b) for b in bins)
        placement = _Placement(-(-fullest // self.arena.block_nbytes), spots)
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
            pool.install(self._views(group, capacity, placement), capacity, moved.get(group, {}))
        self._placement = placement
        self._generation += 1
        return moved

    def _views(
        self, group: GroupName, capacity: int, placement: _Placement
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pool = self._groups[group]
        if capacity == 0:
            return [pool._allocate(0, self.device) for _ in range(pool.num_layers)]
        shapes = pool.shapes(capacity)
        views = []
        for layer in range(pool.num_layers):
            chunks = self.arena.chunks(layer)
            pair = []
            for which, shape in enumerate(shapes):
                chunk, offset = placement.spots[(group, which)]
                nbytes = math.prod(shape) * torch.empty((), dtype=self.dtype).element_size()
                pair.append(chunks[chunk][offset : offset + nbytes].view(self.dtype).view(shape))
            views.append((pair[0], pair[1]))
        return views

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
        if placement.num_blocks > self.arena.num_blocks:
            return [f"the layout needs {placement.num_blocks} blocks, the arena {self.arena.num_blocks}"]
        errors: list[str] = []
        for layer in range(self.spec.num_layers):
            chunks = self.arena.chunks(layer)
            spans: list[tuple[int, int, str]] = []
            for group, pool in self._groups.items():
                if pool.capacity == 0:
                    continue
                for which, tensor in enumerate(pool.layers[layer]):
                    chunk, offset = placement.spots[(group, which)]
                    base = chunks[chunk].data_ptr()
                    start = tensor.data_ptr()
                    if start != base + offset or offset + tensor.nbytes > chunks[chunk].nbytes:
                        errors.append(f"layer {layer} {group}[{which}] is not where the layout puts it")
                    spans.append((start, start + tensor.nbytes, f"{group}[{which}]"))
            spans.sort()
            for (_, end, name), (start, _, other) in itertools.pairwise(spans):
                if start < end:
                    errors.append(f"layer {layer}: {name} and {other} overlap")
        return errors

    def groups(self) -> Iterator[GroupName]:
        return iter(self._groups)
