"""Float weights as a format: float16 and bfloat16 halve the bytes a step streams; float32
holds a fused projection whose parts came in different block formats (exact, no re-rounding)."""

from __future__ import annotations

import torch

from loraplex.kernels.contracts import WeightFormat, WeightFormatName


class _FloatFormat(WeightFormat):
    block_size = 16
    dtype: torch.dtype

    def dequantize(self, data: torch.Tensor, in_features: int) -> torch.Tensor:
        return data.contiguous().view(self.dtype).float().reshape(data.shape[0], in_features)

    def quantize(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to(self.dtype).contiguous().view(torch.uint8)


class F32(_FloatFormat):
    name: WeightFormatName = "f32"
    block_bytes = 64
    c_id = 7
    dtype = torch.float32


class F16(_FloatFormat):
    name: WeightFormatName = "f16"
    block_bytes = 32
    c_id = 4
    dtype = torch.float16


class BF16(_FloatFormat):
    name: WeightFormatName = "bf16"
    block_bytes = 32
    c_id = 5
    dtype = torch.bfloat16
