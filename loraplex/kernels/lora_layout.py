"""How a LoRA backend stores the stacked adapter weights of one projection group.

The slot buffers (``adapters/slot_buffers.py``) ask the engine's LoRA backend for its
layout and store every resident adapter in it, so each backend reads the bytes in the
order its kernels stream them, with no repacking per step. The *logical* layout,
which the torch and Triton backends read, is::

    lora_a: [num_slices, max_loras, max_rank, in_features]
    lora_b: [num_slices, max_loras, max_out, max_rank]

A layout allocates the pair, writes one adapter module into a slot, clears a slot,
and gives the logical view back (a copy where the bytes do not allow a view), for
fallbacks, tests and inspection.
"""

from __future__ import annotations

import torch


class LoRAWeightLayout:
    """The logical layout itself."""

    name = "logical"
    slot_dims: tuple[int, int] = (1, 1)
    """The dimension of ``lora_a`` and of ``lora_b`` that indexes slots (pages)."""

    def allocate(
        self,
        num_slices: int,
        max_loras: int,
        max_rank: int,
        in_features: int,
        max_out: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed ``(lora_a, lora_b)`` buffers for every slot."""
        lora_a = torch.zeros(num_slices, max_loras, max_rank, in_features, dtype=dtype, device=device)
        lora_b = torch.zeros(num_slices, max_loras, max_out, max_rank, dtype=dtype, device=device)
        return lora_a, lora_b

    def clear_slot(self, lora_a: torch.Tensor, lora_b: torch.Tensor, slot: int) -> None:
        """Zero every slice of ``slot``."""
        lora_a[:, slot].zero_()
        lora_b[:, slot].zero_()

    def write(
        self,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        slice_idx: int,
        slot: int,
        module_a: torch.Tensor,  # [rank, in_features]
        module_b: torch.Tensor,  # [out_features, rank], scaling folded in
        *,
        non_blocking: bool = False,
    ) -> None:
        """Store one module's A and B as slice ``slice_idx`` of ``slot`` (cleared before)."""
        rank, out_features = module_a.shape[0], module_b.shape[0]
        lora_a[slice_idx, slot, :rank].copy_(module_a, non_blocking=non_blocking)
        lora_b[slice_idx, slot, :out_features, :rank].copy_(module_b, non_blocking=non_blocking)

    def logical(self, lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers in the logical layout (here: themselves)."""
        return lora_a, lora_b

    def pack(self, lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical ``(lora_a, lora_b)`` copied into this layout (tests and benchmarks)."""
        num_slices, max_loras, max_rank, in_features = lora_a.shape
        packed_a, packed_b = self.allocate(
            num_slices, max_loras, max_rank, in_features, lora_b.shape[2], lora_a.dtype, lora_a.device
        )
        for s in range(num_slices):
            for slot in range(max_loras):
                self.write(packed_a, packed_b, s, slot, lora_a[s, slot], lora_b[s, slot])
        return packed_a, packed_b


LOGICAL_LAYOUT = LoRAWeightLayout()
