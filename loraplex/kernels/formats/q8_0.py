"""GGUF Q8_0: blocks of 32 weights, ``d * q`` with a float16 ``d`` and int8 ``q`` (34 bytes)."""

from __future__ import annotations

import torch

from loraplex.kernels.contracts import WeightFormat, WeightFormatName
from loraplex.kernels.formats.blocks import as_blocks, f16_field


class Q8_0(WeightFormat):
    name: WeightFormatName = "q8_0"
    block_size = 32
    block_bytes = 34
    c_id = 1

    def dequantize(self, data: torch.Tensor, in_features: int) -> torch.Tensor:
        blocks = as_blocks(data, self.block_bytes)
        d = f16_field(blocks, 0)
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(data.shape[0], in_features)

    def quantize(self, weight: torch.Tensor) -> torch.Tensor:
        # ggml's quantize_row_q8_0_ref: d = amax / 127, q = round(w / d) (half away from zero).
        rows = weight.shape[0]
        w = weight.float().reshape(-1, self.block_size)
        d = w.abs().amax(dim=1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        scaled = w * inv
        q = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)
        out = torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], dim=1)
        return out.reshape(rows, -1)
