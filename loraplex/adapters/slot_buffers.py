"""The device tier: stacked, rank-padded LoRA buffers for every layer and projection group.

For each layer and group (see ``spec.GROUPS``), in the LoRA backend's weight layout
(``kernels/lora_layout.py``), whose logical form is::

    lora_a: [num_slices, max_loras, max_rank, in_features]
    lora_b: [num_slices, max_loras, max_out, max_rank]      max_out = max(slice_sizes)
    scales: [max_loras] float32, shared by every layer and group

The CPU backend asks for a packed layout (A^T with the slices side by side, B in
64-column panels) that its kernel streams; the torch and Triton backends read the
logical one.

A slot holds one adapter: rows ``[:rank]`` of A and columns ``[:rank]`` / rows
``[:out_features]`` of B are its weights (B already scaled), everything else is zero,
so a module the adapter does not target contributes nothing. ``scales`` is 1.0 for
an occupied slot and 0.0 for a free one, so a token that wrongly points at a free
slot still gets no delta.

Writing a slot touches only that slot's rows, which no token in flight reads (the
slot is free or was evicted with no pins): other slots keep serving meanwhile. On
CUDA the copies come from pinned host memory with ``non_blocking=True``, on the
current stream, so they are ordered before the next forward that reads them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from loraplex.adapters.peft_weights import AdapterWeights
from loraplex.adapters.spec import GROUPS, BaseModelSpec, GroupName
from loraplex.kernels.lora_layout import LOGICAL_LAYOUT, LoRAWeightLayout


class SlotBuffers(NamedTuple):
    """What one fused projection passes to ``LoRABackend.apply``."""

    lora_a: torch.Tensor  # in the backend's layout; logically [num_slices, max_loras, max_rank, in_features]
    lora_b: torch.Tensor  # in the backend's layout; logically [num_slices, max_loras, max_out, max_rank]
    scales: torch.Tensor  # [max_loras] float32
    slice_sizes: tuple[int, ...]


class LoRASlotBuffers:
    """Allocates the stacked buffers once and writes adapters into slots."""

    def __init__(
        self,
        spec: BaseModelSpec,
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        *,
        layout: LoRAWeightLayout = LOGICAL_LAYOUT,
    ) -> None:
        self.spec = spec
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.layout = layout
        self.scales = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self._buffers: list[dict[GroupName, SlotBuffers]] = []
        for _ in range(spec.num_layers):
            per_group: dict[GroupName, SlotBuffers] = {}
            for group, modules in GROUPS.items():
                sizes = spec.slice_sizes(group)
                in_features = spec.group_in_features(group)
                lora_a, lora_b = layout.allocate(
                    len(modules), max_loras, max_rank, in_features, max(sizes), dtype, device
                )
                per_group[group] = SlotBuffers(lora_a, lora_b, self.scales, sizes)
            self._buffers.append(per_group)

    def get(self, layer_idx: int, group: GroupName) -> SlotBuffers:
        """Buffers of ``group`` in layer ``layer_idx``, in the layout."""
        return self._buffers[layer_idx][group]

    def get_logical(self, layer_idx: int, group: GroupName) -> SlotBuffers:
        """The same buffers in the logical layout (a copy where the layout needs one)."""
        buf = self._buffers[layer_idx][group]
        lora_a, lora_b = self.layout.logical(buf.lora_a, buf.lora_b)
        return SlotBuffers(lora_a, lora_b, buf.scales, buf.slice_sizes)

    @property
    def nbytes(self) -> int:
        """Device memory of all buffers."""
        total = self.scales.numel() * self.scales.element_size()
        for per_group in self._buffers:
            for buf in per_group.values():
                total += buf.lora_a.numel() * buf.lora_a.element_size()
                total += buf.lora_b.numel() * buf.lora_b.element_size()
        return total

    def write(self, slot_idx: int, weights: AdapterWeights) -> None:
        """Load ``weights`` (host, serving dtype) into ``slot_idx`` and mark it occupied."""
        if weights.max_rank > self.max_rank:
            raise ValueError(f"adapter rank {weights.max_rank} > slot max_rank {self.max_rank}")
        non_blocking = self.device.type == "cuda"
        for layer_idx, per_group in enumerate(self._buffers):
            for group, modules in GROUPS.items():
                buf = per_group[group]
                self.layout.clear_slot(buf.lora_a, buf.lora_b, slot_idx)
                for slice_idx, module in enumerate(modules):
                    w = weights.modules.get((layer_idx, module))
                    if w is None:
                        continue
                    self.layout.write(
                        buf.lora_a,
                        buf.lora_b,
                        slice_idx,
                        slot_idx,
                        w.lora_a,
                        w.lora_b,
                        non_blocking=non_blocking,
                    )
        self.scales[slot_idx] = 1.0

    def clear(self, slot_idx: int) -> None:
        """Mark ``slot_idx`` free: scale 0, so stray tokens get no delta (weights stay until reuse)."""
        self.scales[slot_idx] = 0.0
