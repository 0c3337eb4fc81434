"""One projection group's pages: their tensors in every layer, their scales, the free list.

A ``GroupPool`` holds, per layer, the group's ``lora_a`` / ``lora_b`` tensors of
``capacity`` pages in the LoRA backend's weight layout (``layout.allocate(num_slices,
capacity, P, in_features, max_out)``), ``scales[page]`` (1.0 for a page in use, 0.0 for a
free one, so a token that wrongly points at a free page still gets no delta) and the free
list (a heap: the lowest free page first). It writes an adapter's rank rows into its pages
(page i = rows ``[iP, (i+1)P)``), plans a compaction (which pages in use move below a
smaller capacity) and installs new tensors, copying the pages in use over. Where the
tensors lie in the arena is ``page_placement.py``'s; when they are re-laid, ``page_pool.py``'s.

Writing a page touches only that page's rows, which no token in flight reads (it is
free); on CUDA the copies are ``non_blocking`` from pinned host memory on the current
stream, so they are ordered before the next forward that reads them.
"""

from __future__ import annotations

import heapq

import torch

from loraplex.adapters.peft_weights import AdapterWeights
from loraplex.adapters.spec import GROUPS, BaseModelSpec, GroupName
from loraplex.kernels.lora_layout import LoRAWeightLayout


class GroupPool:
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
        a, b = self.allocate_tensors(1, torch.device("meta"))
        a2, b2 = self.allocate_tensors(2, torch.device("meta"))
        # The pool re-lays tensors by page count, so a tensor must be linear in it.
        assert (a2.numel(), b2.numel()) == (2 * a.numel(), 2 * b.numel()), layout.name
        self.a_nbytes, self.b_nbytes = a.numel() * elem, b.numel() * elem  # one page, one layer
        self.page_nbytes = (self.a_nbytes + self.b_nbytes) * self.num_layers
        self.capacity = 0
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            self.allocate_tensors(0, device) for _ in range(self.num_layers)
        ]
        self.scales = torch.zeros(0, dtype=torch.float32, device=device)
        self.free: list[int] = []  # a heap: the lowest free page first

    def allocate_tensors(self, capacity: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's A and B tensors of ``capacity`` pages, in the layout (fresh memory)."""
        return self.layout.allocate(
            self.num_slices, capacity, self.page_rank, self.in_features, max(self.sizes), self.dtype, device
        )

    def shapes(self, capacity: int) -> tuple[torch.Size, torch.Size]:
        a, b = self.allocate_tensors(capacity, torch.device("meta"))
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
