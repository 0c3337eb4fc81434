"""GGUF Q4_0: blocks of 32 weights, ``d * (q - 8)`` with a float16 ``d`` and 4-bit ``q`` (18 bytes).

Byte ``j`` of the 16 holds weight ``j`` in its low nibble and weight ``j + 16`` in its high one.
"""

from __future__ import annotations

import torch

from loraplex.kernels.contracts import WeightFormat, WeightFormatName
from loraplex.kernels.formats.blocks import as_blocks, f16_field, nibbles


class Q4_0(WeightFormat):
    name: WeightFormatName = "q4_0"
    block_size = 32
    block_bytes = 18
    c_id = 2

    def dequantize(self, data: torch.Tensor, in_features: int) -> torch.Tensor:
        blocks = as_blocks(data, self.block_bytes)
        d = f16_field(blocks, 0)
        q = nibbles(blocks[:, 2:]).to(torch.int8) - 8
        return (d * q.float()).reshape(data.shape[0], in_features)

    def quantize(self, weight: torch.Tensor) -> torch.Tensor:
        # ggml's quantize_row_q4_0_ref: d = (the weight of largest magnitude) / -8.
        rows = weight.shape[0]
        w = weight.float().reshape(-1, self.block_size)
        peak = w.gather(1, w.abs().argmax(dim=1, keepdim=True))
        d = peak / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = (w * inv + 8.5).trunc().clamp(0, 15).to(torch.uint8)
        qs = q[:, :16] | (q[:, 16:] << 4)
        return torch.cat([d.half().view(torch.uint8), qs], dim=1).reshape(rows, -1)
