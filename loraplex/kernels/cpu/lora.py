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

_ARGTYPES = (
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_void_p,
    ctypes.c_int64,
    *[ctypes.c_void_p] * 7,
    *[ctypes.c_int64] * 7,
    ctypes.c_int,
)


def _kernel() -> Any | None:
    return bind("loraplex_lora_grouped_f32", _ARGTYPES)


@functools.lru_cache(maxsize=64)
def _slice_sizes_tensor(slice_sizes: tuple[int, ...]) -> torch.Tensor:
    # A handful of distinct tuples (one per projection kind), asked for in every layer.
    return torch.tensor(slice_sizes, dtype=torch.int64)


@dataclass(frozen=True)
class TokenGroups:
    """Token indices grouped by adapter slot (int64 tensors for the kernel)."""

    tokens: torch.Tensor  # [num_grouped_tokens], token indices, group after group
    starts: torch.Tensor  # [num_groups + 1], offsets into tokens
    slots: torch.Tensor  # [num_groups]

    @property
    def num_groups(self) -> int:
        return int(self.slots.shape[0])

    @functools.cached_property
    def pointers(self) -> tuple[int, int, int]:
        """Addresses of tokens, starts and slots, as the kernel takes them (one step's
        groups serve every projection of every layer: computed once)."""
        return (self.tokens.data_ptr(), self.starts.data_ptr(), self.slots.data_ptr())

    @staticmethod
    def from_slot_tokens(by_slot: dict[int, list[int]]) -> TokenGroups:
        """Groups from ``{slot: token indices}``."""
        tokens: list[int] = []
        starts = [0]
        for tok in by_slot.values():
            tokens += tok
            starts.append(len(tokens))
        return TokenGroups(
            torch.tensor(tokens, dtype=torch.int64),
            torch.tensor(starts, dtype=torch.int64),
            torch.tensor(list(by_slot), dtype=torch.int64),
        )

    @staticmethod
    def from_meta(meta: LoRAMetadata) -> TokenGroups:
        """Every token with an adapter, grouped by slot (segments of one slot merged)."""
        starts = meta.seg_starts_cpu or tuple(meta.seg_starts.tolist())
        seg_slots = meta.seg_slots_cpu or tuple(meta.seg_slots.tolist())
        by_slot: dict[int, list[int]] = {}
        for i, slot in enumerate(seg_slots):
            if slot >= 0 and starts[i + 1] > starts[i]:
                by_slot.setdefault(slot, []).extend(range(starts[i], starts[i + 1]))
        return TokenGroups.from_slot_tokens(by_slot)


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
    assert weights.takes(y, x), (
        "C LoRA kernel: x / y do not fit these weights (float32 CPU, unit column stride)"
    )
    if groups.num_groups == 0:
        return
    kernel = _kernel()
    assert kernel is not None
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
        self._groups_meta: LoRAMetadata | None = None
        self._groups: TokenGroups | None = None
        self._weights: dict[tuple[int, int, int, tuple[int, ...]], PackedWeights] = {}

    def weight_layout(self, dtype: torch.dtype, device: torch.device) -> LoRAWeightLayout:
        if device.type == "cpu" and dtype == torch.float32 and _kernel() is not None:
            return CPU_PACKED_LAYOUT
        return LOGICAL_LAYOUT

    def _token_groups(self, meta: LoRAMetadata) -> TokenGroups:
        # One LoRAMetadata serves every projection of a step: group its tokens once.
        if self._groups_meta is not meta or self._groups is None:
            self._groups = TokenGroups.from_meta(meta)
            self._groups_meta = meta
        return self._groups

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
