"""Per-channel weight-only int8, made at load time from any float checkpoint.

A row is ``in_features`` int8 weights then its float32 scale (4 bytes): ``w = scale * q``
with ``scale = max |w_row| / 127`` and ``q = round(w / scale)``. Lossy (unlike reading a GGUF
file's own blocks), so the engine's token-for-token fidelity tests do not cover it.
"""

from __future__ import annotations

import torch

from loraplex.kernels.contracts import WeightFormat, WeightFormatName


class Int8PerChannel(WeightFormat):
    name: WeightFormatName = "int8"
    block_size = 16
    block_bytes = 16
    c_id = 6
    row_extra_bytes = 4

    def dequantize(self, data: torch.Tensor, in_features: int) -> torch.Tensor:
        q = data[:, :in_features].contiguous().view(torch.int8).float()
        scale = data[:, in_features:].contiguous().view(torch.float32)  # [rows, 1]
        return q * scale

    def quantize(self, weight: torch.Tensor) -> torch.Tensor:
        w = weight.float()
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)
