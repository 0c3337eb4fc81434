"""The CPU LoRA backend: one call of the C grouped kernel per projection for every token.

    y[t, slice] += scale[s] * (x[t] @ A[s]^T) @ B[s]^T      s = token_slots[t], -1 = none

A step's tokens are grouped by adapter slot (decodes, short chunks and prefill runs
alike) and ``lora_grouped.c`` serves them all in one call per projection: register
tiles of 4 tokens for the shrink and the expand, each adapter's A and B read about
once per 16 tokens. That replaces the torch path's padded buckets (a dozen ops each)
for decodes, and for prefill runs it beats MKL's GEMMs, whose rank-wide shapes
(N = rank in the shrink, K = rank in the expand) run far below peak. The kernel reads
B transposed, which the CPU slot buffers provide (``lora_b_rank_major``); other
layouts and dtypes take the torch path.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.kernels.cpu.build import bind, limit
from loraplex.kernels.metadata import LoRAMetadata
from loraplex.kernels.torch_ref.lora import TorchLoRABackend

_ARGTYPES = (
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_void_p,
    ctypes.c_int64,
    *[ctypes.c_void_p] * 7,
    *[ctypes.c_int64] * 6,
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


def supports(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> bool:
    """True when the C kernel can serve these tensors (float32 CPU, B stored rank-major)."""
    if _kernel() is None or not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (y, x)):
        return False
    if lora_a.dtype != torch.float32 or lora_b.dtype != torch.float32 or not lora_a.is_contiguous():
        return False
    num_slices, _, max_rank, _ = lora_a.shape
    return (
        lora_b.transpose(2, 3).is_contiguous()
        and x.stride(1) == 1
        and y.stride(1) == 1
        and max_rank <= limit("loraplex_lora_max_rank")
        and num_slices <= limit("loraplex_lora_max_slices")
    )


def lora_grouped_cpu(
    y: torch.Tensor,  # [num_tokens, sum(slice_sizes)], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [num_slices, max_loras, max_rank, in_features]
    lora_b: torch.Tensor,  # [num_slices, max_loras, max_out, max_rank], stored rank-major
    scales: torch.Tensor,  # [max_loras] float32
    slice_sizes: tuple[int, ...],
    groups: TokenGroups,
) -> None:
    """Add every grouped token's LoRA delta into ``y`` with the C kernel (``supports`` first)."""
    assert supports(y, x, lora_a, lora_b), "C LoRA kernel does not support these tensors"
    num_slices, num_slots, max_rank, in_features = lora_a.shape
    max_out = lora_b.shape[2]
    assert lora_b.shape[:2] == (num_slices, num_slots) and lora_b.shape[3] == max_rank, "lora_b shape"
    assert len(slice_sizes) == num_slices and max(slice_sizes) <= max_out, "slice_sizes"
    assert x.shape[1] == in_features and y.shape[0] == x.shape[0], "x / y rows"
    assert y.shape[1] >= sum(slice_sizes), "y columns"
    assert scales.dtype == torch.float32 and scales.is_contiguous() and scales.shape[0] == num_slots, "scales"
    if groups.num_groups == 0:
        return
    sizes = _slice_sizes_tensor(tuple(slice_sizes))
    kernel = _kernel()
    assert kernel is not None
    bad = kernel(
        x.data_ptr(),
        x.stride(0),
        y.data_ptr(),
        y.stride(0),
        lora_a.data_ptr(),
        lora_b.data_ptr(),
        scales.data_ptr(),
        groups.tokens.data_ptr(),
        groups.starts.data_ptr(),
        groups.slots.data_ptr(),
        sizes.data_ptr(),
        groups.num_groups,
        num_slices,
        num_slots,
        max_rank,
        in_features,
        max_out,
        torch.get_num_threads(),
    )
    if bad < 0:
        raise MemoryError("LoRA: the C kernel could not allocate its work list")
    if bad:
        raise ValueError(f"LoRA: {bad} token groups point at a slot outside [0, {num_slots})")


class CpuLoRABackend(TorchLoRABackend):
    """LoRA by the compiled C kernel (CPU, float32); the torch path for what it cannot read."""

    name = "cpu"
    lora_b_rank_major = True

    def __init__(self) -> None:
        super().__init__()
        self._groups_meta: LoRAMetadata | None = None
        self._groups: TokenGroups | None = None

    def _token_groups(self, meta: LoRAMetadata) -> TokenGroups:
        # One LoRAMetadata serves every projection of a step: group its tokens once.
        if self._groups_meta is not meta or self._groups is None:
            self._groups = TokenGroups.from_meta(meta)
            self._groups_meta = meta
        return self._groups

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
        if not supports(y, x, lora_a, lora_b):
            super().apply(y, x, lora_a, lora_b, scales, slice_sizes, meta)
            return
        lora_grouped_cpu(y, x, lora_a, lora_b, scales, slice_sizes, self._token_groups(meta))
