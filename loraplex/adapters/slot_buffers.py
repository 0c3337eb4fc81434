"""``SlotBuffers``: what one fused projection hands the LoRA backend.

The buffers are one projection group's page pool in one layer (``page_pool.py``), in the
LoRA backend's weight layout; their "slot" dimension indexes pages of ``lora_page_rank``
rank rows, and ``scales`` is 1.0 for a page in use, 0.0 for a free one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SlotBuffers(NamedTuple):
    """What one fused projection passes to ``LoRABackend.apply``."""

    lora_a: torch.Tensor  # in the backend's layout; logically [num_slices, max_loras, max_rank, in_features]
    lora_b: torch.Tensor  # in the backend's layout; logically [num_slices, max_loras, max_out, max_rank]
    scales: torch.Tensor  # [max_loras] float32
    slice_sizes: tuple[int, ...]
