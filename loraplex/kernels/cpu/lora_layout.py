"""The packed LoRA layout the CPU kernel (``lora_grouped.c``) streams.

::

    lora_a: [max_loras, in_features, n_pad]     column s * max_rank + k = row k of slice s's A
    lora_b: [num_slices, max_loras, num_panels, max_rank, PANEL]
                                                lora_b[s, l, p, k, c] = B[s, l][p * PANEL + c, k]

with ``n_pad = num_slices * max_rank`` rounded up to 8 and ``PANEL = 64`` output
columns. Why: the shrink broadcasts ``x[t, d]`` against row ``d`` of A^T, all slices
at once, so it needs no horizontal sums and reads one contiguous run per slot; the
expand adds one panel of B (``max_rank x 64`` floats, contiguous) into 4 token rows
at a time. Stored as ``[max_out, rank]`` rows, the expand's 16 rank rows sat 57 KiB
apart on Llama-3-8B's gate/up and the hardware prefetcher could not follow them.

The logical view of A is a strided view of these bytes; that of B is a copy.
"""

from __future__ import annotations

import torch

from loraplex.kernels.lora_layout import LoRAWeightLayout

PANEL = 64  # output columns per B panel; must match PW in lora_grouped.c
VECTOR = 8  # the shrink's columns are padded to a multiple of it: whole 16-float vectors and at
# most one 8-float half (16 padded a rank-8 page of o or down to twice its bytes, which a
# decode step streams once per token group)


def padded_columns(num_slices: int, max_rank: int) -> int:
    """``n_pad``: the rank columns of every slice side by side, rounded up to 8."""
    return -(-num_slices * max_rank // VECTOR) * VECTOR


class CpuPackedLoRALayout(LoRAWeightLayout):
    """A^T with every slice side by side, B^T in 64-column panels (see the module doc)."""

    name = "cpu-packed"
    slot_dims = (0, 1)

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
        n_pad = padded_columns(num_slices, max_rank)
        num_panels = -(-max_out // PANEL)
        lora_a = torch.zeros(max_loras, in_features, n_pad, dtype=dtype, device=device)
        lora_b = torch.zeros(num_slices, max_loras, num_panels, max_rank, PANEL, dtype=dtype, device=device)
        return lora_a, lora_b

    def clear_slot(self, lora_a: torch.Tensor, lora_b: torch.Tensor, slot: int) -> None:
        lora_a[slot].zero_()
        lora_b[:, slot].zero_()

    def write(
        self,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        slice_idx: int,
        slot: int,
        module_a: torch.Tensor,  # [rank, in_features]
        module_b: torch.Tensor,  # [out_features, rank]
        *,
        non_blocking: bool = False,
    ) -> None:
        rank, out_features = module_a.shape[0], module_b.shape[0]
        num_panels, max_rank = lora_b.shape[2], lora_b.shape[3]
        col = slice_idx * max_rank
        lora_a[slot, :, col : col + rank].copy_(module_a.t(), non_blocking=non_blocking)
        # Rows past out_features stay zero: a panel is read whole.
        rows = torch.zeros(num_panels * PANEL, rank, dtype=lora_b.dtype, device=lora_b.device)
        rows[:out_features] = module_b
        lora_b[slice_idx, slot, :, :rank].copy_(rows.view(num_panels, PANEL, rank).transpose(1, 2))

    def logical(self, lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_slices, max_loras, num_panels, max_rank, _ = lora_b.shape
        a = lora_a[:, :, : num_slices * max_rank].unflatten(2, (num_slices, max_rank)).permute(2, 0, 3, 1)
        b = lora_b.transpose(3, 4).reshape(num_slices, max_loras, num_panels * PANEL, max_rank)
        return a, b


CPU_PACKED_LAYOUT = CpuPackedLoRALayout()
