"""Byte-level helpers shared by the block formats' torch references."""

from __future__ import annotations

import torch


def as_blocks(data: torch.Tensor, block_bytes: int) -> torch.Tensor:  # [rows * blocks, block_bytes]
    """A [rows, row_bytes] uint8 tensor as one block per row."""
    return data.reshape(-1, block_bytes)


def f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:  # [n, 1] float32
    """The little-endian float16 at byte ``offset`` of each block, as float32."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def nibbles(qs: torch.Tensor) -> torch.Tensor:  # [n, 2 * bytes] uint8
    """ggml's nibble order: the low nibbles of a run of bytes, then their high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)
