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

Memory: every group pool starts empty and grows (doubling, by reallocation, between
steps) while the bytes of all pools stay within ``budget_bytes``; past that, the
adapter manager evicts least-recently-used unpinned adapters to free pages. Free pages
are reused by their group; when another group needs their bytes, their group is
*compacted* (pages in use move down, the pool shrinks) and the adapters' page tables
follow the moves. So what fits is simple: the pages in use plus the new adapter's pages
within ``budget_bytes``, whatever the groups. ``scales[page]``
is 1.0 for an allocated page and 0.0 for a free one, so a token that wrongly points at
a free page still gets no delta.

Writing a page touches only that page's rows, which no token in flight reads (it is
free); on CUDA the copies are ``non_blocking`` from pinned host memory on the current
stream, so they are ordered before the next forward that reads them.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping

import torch

from loraplex.adapters.peft_weights import AdapterWeights
from loraplex.adapters.slot_buffers import SlotBuffers
from loraplex.adapters.spec import GROUPS, BaseModelSpec, GroupName
from loraplex.kernels.lora_layout import LOGICAL_LAYOUT, LoRAWeightLayout

PageTable = dict[GroupName, list[int]]
"""An adapter's pages per group it targets (page ids index that group's pool)."""

MIN_GROWTH_PAGES = 8
"""Smallest growth step of a group pool: growing reallocates the whole group, so not page by page."""


def pages_needed(weights: AdapterWeights, page_rank: int) -> dict[GroupName, int]:
    """Pages an adapter needs per group: its largest rank in the group, in pages (rounded up)."""
    rank: dict[GroupName, int] = {}
    module_group = {m: g for g, modules in GROUPS.items() for m in modules}
    for (_layer, module), w in weights.modules.items():
        group = module_group[module]
        rank[group] = max(rank.get(group, 0), int(w.lora_a.shape[0]))
    return {g: -(-r // page_rank) for g, r in rank.items() if r > 0}


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
        a, b = self._allocate(1, torch.device("meta"))
        self.page_nbytes = (a.numel() + b.numel()) * a.element_size() * self.num_layers
        self.capacity = 0
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            self._allocate(0, device) for _ in range(self.num_layers)
        ]
        self.scales = torch.zeros(0, dtype=torch.float32, device=device)
        self.free: list[int] = []  # a heap: the lowest free page first
        self.generation = 0  # bumped by every reallocation (tensors change identity)

    def _allocate(self, capacity: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layout.allocate(
            self.num_slices, capacity, self.page_rank, self.in_features, max(self.sizes), self.dtype, device
        )

    @property
    def num_used(self) -> int:
        return self.capacity - len(self.free)

    def grow(self, capacity: int) -> None:
        """Reallocate every layer with ``capacity`` pages, keeping the pages in use."""
        old = self.capacity
        assert capacity > old
        a_dim, b_dim = self.layout.slot_dims
        layers = []
        for old_a, old_b in self.layers:
            new_a, new_b = self._allocate(capacity, self.device)
            new_a.narrow(a_dim, 0, old).copy_(old_a)
            new_b.narrow(b_dim, 0, old).copy_(old_b)
            layers.append((new_a, new_b))
        self.layers = layers
        scales = torch.zeros(capacity, dtype=torch.float32, device=self.device)
        scales[:old] = self.scales
        self.scales = scales
        for page in range(old, capacity):
            heapq.heappush(self.free, page)
        self.capacity = capacity
        self.generation += 1

    def compact(self, keep_free: int = 0) -> dict[int, int]:
        """Move the pages in use below ``num_used + keep_free`` and drop the pages above it.

        Returns ``{old page: new page}`` for the pages that moved (the owners' page tables
        must follow). Called between steps only: a step reads its page tables at its start.
        """
        keep = min(self.capacity, self.num_used + keep_free)
        free = set(self.free)
        moved_from = [p for p in range(keep, self.capacity) if p not in free]
        free_low = sorted(p for p in free if p < keep)
        remap = dict(zip(moved_from, free_low, strict=False))
        assert len(remap) == len(moved_from)
        a_dim, b_dim = self.layout.slot_dims
        for a, b in self.layers:
            for src, dst in remap.items():
                a.narrow(a_dim, dst, 1).copy_(a.narrow(a_dim, src, 1))
                b.narrow(b_dim, dst, 1).copy_(b.narrow(b_dim, src, 1))
        for src, dst in remap.items():
            self.scales[dst] = self.scales[src]
        self.layers = [
            (a.narrow(a_dim, 0, keep).clone(), b.narrow(b_dim, 0, keep).clone()) for a, b in self.layers
        ]
        self.scales = self.scales[:keep].clone()
        self.free = free_low[len(remap) :]
        heapq.heapify(self.free)
        self.capacity = keep
        self.generation += 1
        return remap

    def take(self, n: int) -> list[int]:
        assert len(self.free) >= n, f"{self.group}: {n} pages wanted, {len(self.free)} free"
        pages = [heapq.heappop(self.free) for _ in range(n)]
        return pages

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
    """Every group's page pool under one byte budget (see the module doc)."""

    def __init__(
        self,
        spec: BaseModelSpec,
        page_rank: int,
        budget_bytes: int,
        device: torch.device,
        dtype: torch.dtype,
        *,
        layout: LoRAWeightLayout = LOGICAL_LAYOUT,
    ) -> None:
        if page_rank < 1:
            raise ValueError(f"page_rank must be >= 1, got {page_rank}")
        self.spec = spec
        self.page_rank = page_rank
        self.budget_bytes = budget_bytes
        self.device = device
        self.dtype = dtype
        self.layout = layout
        self._groups = {g: _GroupPool(spec, g, page_rank, layout, dtype, device) for g in GROUPS}
        smallest = max(p.page_nbytes for p in self._groups.values())
        if budget_bytes < smallest:
            raise ValueError(
                f"the adapter page budget ({budget_bytes} bytes) holds no page: one page of rank "
                f"{page_rank} takes up to {smallest} bytes; raise lora_memory"
            )

    # -- sizes ---------------------------------------------------------------------------

    def page_nbytes(self, group: GroupName) -> int:
        """Bytes of one page of ``group`` (every layer, A and B, in the layout)."""
        return self._groups[group].page_nbytes

    @property
    def nbytes(self) -> int:
        """Bytes the pools hold now (used and free pages)."""
        return sum(p.capacity * p.page_nbytes for p in self._groups.values())

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
        """Changes whenever a pool reallocates (its tensors are new objects then)."""
        return sum(p.generation for p in self._groups.values())

    def need_nbytes(self, need: Mapping[GroupName, int]) -> int:
        return sum(n * self._groups[g].page_nbytes for g, n in need.items())

    def fits(self, need: Mapping[GroupName, int], freed_nbytes: int = 0) -> bool:
        """Whether ``need`` fits beside the pages in use (less ``freed_nbytes`` about to be freed).

        Free pages of any group count: ``allocate`` compacts a group to give its bytes back.
        """
        return self.used_nbytes - freed_nbytes + self.need_nbytes(need) <= self.budget_bytes

    # -- allocation ----------------------------------------------------------------------

    def allocate(self, need: Mapping[GroupName, int]) -> tuple[PageTable, dict[GroupName, dict[int, int]]]:
        """Pages for ``need``, growing pools within the budget; raises if they do not fit.

        Returns the pages and, per group, the pages that compaction moved (``{old: new}``),
        which the caller applies to the page tables of the adapters it holds.
        """
        if not self.fits(need):
            raise MemoryError(f"adapter pages {dict(need)} do not fit in {self.budget_bytes} bytes")
        missing = {g: max(0, n - len(self._groups[g].free)) for g, n in need.items()}
        moved: dict[GroupName, dict[int, int]] = {}
        if self.nbytes + self.need_nbytes(missing) > self.budget_bytes:
            # Give back free pages this allocation does not take (pools only grow otherwise).
            for group, pool in self._groups.items():
                keep = need.get(group, 0) if missing.get(group, 0) == 0 else 0
                if len(pool.free) > keep:
                    moved[group] = pool.compact(keep_free=keep)
            missing = {g: max(0, n - len(self._groups[g].free)) for g, n in need.items()}
        for group, n in missing.items():
            if n == 0:
                continue
            pool = self._groups[group]
            # Grow by doubling (fewer reallocations), but take at most half of what would be
            # left after this allocation, so other groups keep room to grow.
            left = self.budget_bytes - self.nbytes - self.need_nbytes(missing)
            spare = max(0, left) // 2 // pool.page_nbytes
            slack = max(pool.capacity, MIN_GROWTH_PAGES) - n
            pool.grow(pool.capacity + n + max(0, min(slack, spare)))
            missing[group] = 0
        pages = {group: self._groups[group].take(n) for group, n in need.items() if n > 0}
        return pages, {g: m for g, m in moved.items() if m}

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
        errors: list[str] = []
        if self.nbytes > self.budget_bytes:
            errors.append(f"adapter pools hold {self.nbytes} bytes > budget {self.budget_bytes}")
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

    def groups(self) -> Iterator[GroupName]:
        return iter(self._groups)
