"""The CPU LoRA backend: one call of the C grouped kernel per projection for every token.

    y[t, slice] += scale[s] * (x[t] @ A[s]^T) @ B[s]^T      s = token_slots[t], -1 = none

A step's tokens are grouped by adapter slot (decodes, short chunks and prefill runs
alike) and ``lora_grouped.c`` serves them all in one call per projection: register
tiles with no horizontal sums for the shrink and the expand, each adapter's A and B
read about once per 16 tokens. That replaces the portable path's padded buckets (a dozen
ops each) for decodes, and for prefill runs it beats MKL's GEMMs, whose rank-wide
shapes (N = rank in the shrink, K = rank in the expand) run far below peak.

The kernel reads the packed layout of ``lora_layout.py``, which this backend asks the
slot buffers for (``weight_layout``) in float32; other dtypes keep the logical layout
and take the portable path.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.kernels.cpu.build import bind, limit
from loraplex.kernels.cpu.lora_layout import CPU_PACKED_LAYOUT, PANEL, padded_columns
from loraplex.kernels.lora_layout import LOGICAL_LAYOUT, LoRAWeightLayout
from loraplex.kernels.metadata import LoRAMetadata
from loraplex.kernels.portable.lora import PortableLoRABackend
from loraplex.kernels.step_cache import IdentityCache

_ARGTYPES = (
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_void_p,
    ctypes.c_int64,
    *[ctypes.c_void_p] * 8,
    *[ctypes.c_int64] * 7,
    ctypes.c_int,
)

_GroupingKey = LoRAMetadata | tuple[LoRAMetadata, ...]
"""A step's metadata, or the page passes of one group (``apply_paged``)."""


def _kernel() -> Any | None:
    return bind("loraplex_lora_grouped_f32", _ARGTYPES)


def grouped_kernel() -> Any | None:
    """The bound C function ``loraplex_lora_grouped_f32`` (None when the library is not built).

    Its arguments: ``x, x_stride, y, y_stride`` (addresses, strides in floats), then what
    ``CpuLoRABackend.prebind_paged`` returns, then the thread count; it returns 0, the number
    of groups with a slot outside the pool, or -1 when its scratch allocation failed.
    """
    return _kernel()


@dataclass(frozen=True)
class BoundSite:
    """One LoRA site of one step, its kernel arguments fixed: ``args`` follow ``x, x_stride,
    y, y_stride``. Holds the weights and groups, so the addresses stay valid while it lives."""

    args: tuple[int, ...]
    in_features: int
    out_features: int
    weights: PackedWeights
    groups: TokenGroups


@functools.lru_cache(maxsize=64)
def _slice_sizes_tensor(slice_sizes: tuple[int, ...]) -> torch.Tensor:
    # A handful of distinct tuples (one per projection kind), asked for in every layer.
    return torch.tensor(slice_sizes, dtype=torch.int64)


@dataclass(frozen=True)
class TokenGroups:
    """Token indices grouped by adapter, and each group's slots (int64 tensors for the kernel).

    A group's slots are its adapter's pages (one slot for an adapter of rank <= the page
    rank): ``slots[page_starts[g]:page_starts[g + 1]]``.
    """

    tokens: torch.Tensor  # [num_grouped_tokens], token indices, group after group
    starts: torch.Tensor  # [num_groups + 1], offsets into tokens
    page_starts: torch.Tensor  # [num_groups + 1], offsets into slots
    slots: torch.Tensor  # [page_starts[-1]]

    @property
    def num_groups(self) -> int:
        return int(self.starts.shape[0]) - 1

    @functools.cached_property
    def pointers(self) -> tuple[int, int, int, int]:
        """Addresses of tokens, starts, page starts and slots, as the kernel takes them (one
        step's groups serve every projection of every layer: computed once)."""
        tensors = (self.tokens, self.starts, self.page_starts, self.slots)
        return tuple(t.data_ptr() for t in tensors)  # type: ignore[return-value]

    @staticmethod
    def from_slot_tokens(by_slots: dict[int, list[int]] | dict[tuple[int, ...], list[int]]) -> TokenGroups:
        """Groups from ``{slot or tuple of slots: token indices}``."""
        tokens: list[int] = []
        starts = [0]
        slots: list[int] = []
        page_starts = [0]
        for key, tok in by_slots.items():
            tokens += tok
            starts.append(len(tokens))
            slots += key if isinstance(key, tuple) else (key,)
            page_starts.append(len(slots))
        return TokenGroups(
            torch.tensor(tokens, dtype=torch.int64),
            torch.tensor(starts, dtype=torch.int64),
            torch.tensor(page_starts, dtype=torch.int64),
            torch.tensor(slots, dtype=torch.int64),
        )

    @staticmethod
    def from_meta(*metas: LoRAMetadata) -> TokenGroups:
        """Every token with an adapter, grouped by adapter (segments of one adapter merged).

        Several metas are the passes of a paged step: ``metas[i]`` gives each token page
        ``i`` of its adapter. A token's group is keyed by its first page; the later passes
        add their pages to that group's page list (one adapter, one page list).
        """
        if not metas:
            return TokenGroups.from_slot_tokens({})
        first = metas[0]
        starts = first.seg_starts_cpu or tuple(first.seg_starts.tolist())
        seg_slots = first.seg_slots_cpu or tuple(first.seg_slots.tolist())
        by_slot: dict[int, list[int]] = {}
        for i, slot in enumerate(seg_slots):
            if slot >= 0 and starts[i + 1] > starts[i]:
                by_slot.setdefault(slot, []).extend(range(starts[i], starts[i + 1]))
        if len(metas) == 1:
            return TokenGroups.from_slot_tokens(by_slot)
        pages: dict[int, list[int]] = {slot: [slot] for slot in by_slot}
        for meta in metas[1:]:
            m_starts = meta.seg_starts_cpu or tuple(meta.seg_starts.tolist())
            m_slots = meta.seg_slots_cpu or tuple(meta.seg_slots.tolist())
            for i, slot in enumerate(m_slots):
                if slot < 0 or m_starts[i + 1] == m_starts[i]:
                    continue
                # The first page of this run's adapter: the pass-0 segment holding its first token.
                owner = seg_slots[bisect.bisect_right(starts, m_starts[i]) - 1]
                if owner < 0:
                    raise ValueError(f"LoRA pass: tokens at {m_starts[i]} have page {slot} but no first page")
                if slot not in pages[owner]:
                    pages[owner].append(slot)
        return TokenGroups.from_slot_tokens({tuple(pages[slot]): tok for slot, tok in by_slot.items()})


def is_packed(lora_a: torch.Tensor, lora_b: torch.Tensor) -> bool:
    """True for weights in the CPU packed layout (``[slots, in, n_pad]`` / 5-D panels)."""
    return lora_a.dim() == 3 and lora_b.dim() == 5


@dataclass(frozen=True)
class PackedWeights:
    """One projection's packed weights, checked once, and the kernel's arguments for them.

    Holding the tensors keeps their addresses valid for as long as this object lives.
    """

    lora_a: torch.Tensor  # [max_loras, in_features, n_pad]
    lora_b: torch.Tensor  # [num_slices, max_loras, num_panels, max_rank, PANEL]
    scales: torch.Tensor  # [max_loras] float32
    sizes: torch.Tensor  # [num_slices] int64, the slice sizes
    in_features: int
    out_features: int  # sum of the slice sizes
    pointers: tuple[int, ...]  # lora_a, lora_b, scales, sizes
    dims: tuple[int, ...]  # num_slices, max_loras, max_rank, in_features, n_pad, num_panels

    @staticmethod
    def check(
        lora_a: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor, slice_sizes: tuple[int, ...]
    ) -> PackedWeights | None:
        """The weights ready for the kernel, or None when it cannot read them."""
        if _kernel() is None or not is_packed(lora_a, lora_b):
            return None
        tensors = (lora_a, lora_b, scales)
        if not all(
            t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors
        ):
            return None
        num_slices, num_slots, num_panels, max_rank, panel = lora_b.shape
        _, in_features, n_pad = lora_a.shape
        if (
            panel != PANEL
            or limit("loraplex_lora_panel_width") != PANEL
            or n_pad != padded_columns(num_slices, max_rank)
            or max_rank > limit("loraplex_lora_max_rank")
            or num_slices > limit("loraplex_lora_max_slices")
            or len(slice_sizes) != num_slices
            or max(slice_sizes) > num_panels * PANEL
            or lora_a.shape[0] != num_slots
            or scales.shape != (num_slots,)
        ):
            return None
        sizes = _slice_sizes_tensor(tuple(slice_sizes))
        return PackedWeights(
            lora_a,
            lora_b,
            scales,
            sizes,
            in_features,
            sum(slice_sizes),
            (lora_a.data_ptr(), lora_b.data_ptr(), scales.data_ptr(), sizes.data_ptr()),
            (num_slices, num_slots, max_rank, in_features, n_pad, num_panels),
        )

    def takes(self, y: torch.Tensor, x: torch.Tensor) -> bool:
        """True when the kernel can read ``x`` and update ``y`` with these weights."""
        return (
            x.dtype == torch.float32
            and y.dtype == torch.float32
            and x.is_cpu
            and y.is_cpu
            and x.stride(1) == 1
            and y.stride(1) == 1
            and x.shape[1] == self.in_features
            and y.shape[0] == x.shape[0]
            and y.shape[1] >= self.out_features
        )


def supports(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    slice_sizes: tuple[int, ...],
) -> bool:
    """True when the C kernel can serve these tensors (float32 CPU, packed layout)."""
    weights = PackedWeights.check(lora_a, lora_b, scales, slice_sizes)
    return weights is not None and weights.takes(y, x)


def lora_grouped_cpu(
    y: torch.Tensor,  # [num_tokens, sum(slice_sizes)], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    weights: PackedWeights,
    groups: TokenGroups,
) -> None:
    """Add every grouped token's LoRA delta into ``y`` with the C kernel."""
    if not weights.takes(y, x):
        raise ValueError("C LoRA kernel: x / y do not fit these weights (float32 CPU, unit column stride)")
    if groups.num_groups == 0:
        return
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the C kernel is not built")
    bad = kernel(
        x.data_ptr(),
        x.stride(0),
        y.data_ptr(),
        y.stride(0),
        *weights.pointers,
        *groups.pointers,
        groups.num_groups,
        *weights.dims,
        torch.get_num_threads(),
    )
    if bad < 0:
        raise MemoryError("LoRA: the C kernel could not allocate its scratch memory")
    if bad:
        raise ValueError(f"LoRA: {bad} token groups point at a slot outside [0, {weights.dims[1]})")


class CpuLoRABackend(PortableLoRABackend):
    """LoRA by the compiled C kernel (CPU, float32, packed weights); the portable path otherwise."""

    name = "cpu"
    # Checked weights per (buffers, slice sizes): the engine passes the same slot buffers
    # for a projection at every step, and after the caches have turned over (a real step
    # streams every layer's weights), re-checking them cost more than a small kernel.
    max_cached_weights = 1024

    def __init__(self) -> None:
        super().__init__()
        # Token groupings of the step's metadata (one per projection group of a paged step).
        self._token_groupings: IdentityCache[_GroupingKey, TokenGroups] = IdentityCache()
        self._weights: dict[tuple[int, int, int, tuple[int, ...]], PackedWeights] = {}

    def weight_layout(self, dtype: torch.dtype, device: torch.device) -> LoRAWeightLayout:
        if device.type == "cpu" and dtype == torch.float32 and _kernel() is not None:
            return CPU_PACKED_LAYOUT
        return LOGICAL_LAYOUT

    def _token_groups(self, key: _GroupingKey) -> TokenGroups:
        # One metadata (or tuple of passes) serves every layer of a step: group its tokens once.
        return self._token_groupings.get(
            key, lambda k: TokenGroups.from_meta(*k) if isinstance(k, tuple) else TokenGroups.from_meta(k)
        )

    def forget_weights(self) -> None:
        """Drop the checked-weights cache (the page pools reallocated: old tensors can go)."""
        self._weights.clear()

    def _packed_weights(
        self, lora_a: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor, slice_sizes: tuple[int, ...]
    ) -> PackedWeights | None:
        # Keyed by object identity: a cached PackedWeights holds its tensors, so their ids
        # cannot be reused by other tensors while the entry exists.
        key = (id(lora_a), id(lora_b), id(scales), slice_sizes)
        if key in self._weights:
            return self._weights[key]
        if len(self._weights) >= self.max_cached_weights:
            self._weights.clear()
        weights = PackedWeights.check(lora_a, lora_b, scales, slice_sizes)
        if weights is not None:  # a refusal holds no tensors, so it is not cached by id
            self._weights[key] = weights
        return weights

    def packed_weights(
        self, lora_a: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor, slice_sizes: tuple[int, ...]
    ) -> PackedWeights | None:
        """The checked weights of one projection (cached), or None when the kernel cannot read them."""
        return self._packed_weights(lora_a, lora_b, scales, slice_sizes)

    def prebind_paged(self, weights: PackedWeights, passes: tuple[LoRAMetadata, ...]) -> BoundSite | None:
        """``apply_paged``'s kernel call for ``weights`` and a step's ``passes``, as arguments fixed
        once (the CPU graph calls the kernel with them at its site, no Python in between); None
        when no token of the step has pages there."""
        groups = self._token_groups(passes)
        if groups.num_groups == 0:
            return None
        return BoundSite(
            (*weights.pointers, *groups.pointers, groups.num_groups, *weights.dims),
            weights.in_features,
            weights.out_features,
            weights,
            groups,
        )

    def apply(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scales: torch.Tensor,
        slice_sizes: tuple[int, ...],
        meta: LoRAMetadata,
    ) -> None:
        if meta.num_active_slots == 0:
            return
        weights = self._packed_weights(lora_a, lora_b, scales, slice_sizes)
        if weights is not None and weights.takes(y, x):
            lora_grouped_cpu(y, x, weights, self._token_groups(meta))
            return
        if is_packed(lora_a, lora_b):
            # Packed weights the kernel cannot take here (e.g. strided x): the logical
            # view costs a copy of B, but the tokens still get the right delta.
            lora_a, lora_b = CPU_PACKED_LAYOUT.logical(lora_a, lora_b)
        super().apply(y, x, lora_a, lora_b, scales, slice_sizes, meta)

    def apply_paged(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scales: torch.Tensor,
        slice_sizes: tuple[int, ...],
        passes: tuple[LoRAMetadata, ...],
    ) -> None:
        if not passes:
            return
        weights = self._packed_weights(lora_a, lora_b, scales, slice_sizes)
        if weights is not None and weights.takes(y, x):
            # Every pass in one call: a page is a rank-P slot to the kernel, and a token of
            # a rank-2P adapter sits in two pages' groups (its deltas add up in y).
            lora_grouped_cpu(y, x, weights, self._token_groups(passes))
            return
        super().apply_paged(y, x, lora_a, lora_b, scales, slice_sizes, passes)
