"""GGUF Q4_1: blocks of 32 weights, ``d * q + m`` with float16 ``d``, ``m`` and 4-bit ``q`` (20 bytes).

The bundled SmolLM2 file stores every projection in it. Nibble order as Q4_0's.
"""

from __future__ import annotations

import torch

from loraplex.kernels.contracts import WeightFormat, WeightFormatName
from loraplex.kernels.formats.blocks import as_blocks, f16_field, nibbles


class Q4_1(WeightFormat):
    name: WeightFormatName = "q4_1"
    block_size = 32
    block_bytes = 20
    c_id = 3

    def dequantize(self, data: torch.Tensor, in_features: int) -> torch.Tensor:
        blocks = as_blocks(data, self.block_bytes)
        d, m = f16_field(blocks, 0), f16_field(blocks, 2)
        q = nibbles(blocks[:, 4:]).float()
        return (d * q + m).reshape(data.shape[0], in_features)

    def quantize(self, weight: torch.Tensor) -> torch.Tensor:
        # ggml's quantize_row_q4_1_ref: d = (max - min) / 15, m = min.
        rows = weight.shape[0]
        w = weight.float().reshape(-1, self.block_size)
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = ((w - lo) * inv + 0.5).trunc().clamp(0, 15).to(torch.uint8)
        qs = q[:, :16] | (q[:, 16:] << 4)
        head = [d.half().view(torch.uint8), lo.half().view(torch.uint8)]
        return torch.cat([*head, qs], dim=1).reshape(rows, -1)
