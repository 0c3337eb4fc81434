"""GGUF's k-quants Q4_K and Q6_K: super-blocks of 256 weights in sub-blocks with their own scales.

Q4_K (144 bytes): f16 ``d``, f16 ``dmin``, 12 bytes of eight 6-bit scales and mins, 128
bytes of 4-bit q. Sub-block ``s`` (32 weights) is ``d * sc[s] * q - dmin * m[s]``; each
64 weights take the low nibbles of 32 bytes then their high nibbles.

Q6_K (210 bytes): 128 bytes of low nibbles ``ql``, 64 bytes of 2-bit high parts ``qh``,
16 int8 scales, f16 ``d``; sub-block ``s`` (16 weights) is ``d * sc[s] * (q - 32)``.
"""

from __future__ import annotations

import torch

from loraplex.kernels.contracts import WeightFormat, WeightFormatName
from loraplex.kernels.formats.blocks import as_blocks, f16_field

QK_K = 256


def q4k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # each [n, 8] float32
    """The eight 6-bit scales and mins of Q4_K's 12 packed bytes (ggml's get_scale_min_k4)."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float(), mins.float()


class Q4K(WeightFormat):
    name: WeightFormatName = "q4_k"
    block_size = QK_K
    block_bytes = 144
    c_id = 8

    def dequantize(self, data: torch.Tensor, in_features: int) -> torch.Tensor:
        blocks = as_blocks(data, self.block_bytes)
        n = blocks.shape[0]
        d, dmin = f16_field(blocks, 0), f16_field(blocks, 2)
        sc, mins = q4k_scales_mins(blocks[:, 4:16])
        scale = (d * sc).reshape(n, 8, 1)
        offset = (dmin * mins).reshape(n, 8, 1)
        qs = blocks[:, 16:].reshape(n, 4, 1, 32)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).float()
        return (scale * q - offset).reshape(data.shape[0], in_features)


class Q6K(WeightFormat):
    name: WeightFormatName = "q6_k"
    block_size = QK_K
    block_bytes = 210
    c_id = 9

    def dequantize(self, data: torch.Tensor, in_features: int) -> torch.Tensor:
        blocks = as_blocks(data, self.block_bytes)
        n = blocks.shape[0]
        ql = blocks[:, 0:128].reshape(n, 2, 1, 64)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
        sc = blocks[:, 192:208].contiguous().view(torch.int8).float()
        d = f16_field(blocks, 208)
        scale = (d * sc).reshape(n, 16, 1)
        low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 2, 4, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=data.device).reshape(1, 1, 4, 1)
        high = (qh >> shifts) & 0x03
        q = (low | (high << 4)).to(torch.int8) - 32
        return (scale * q.reshape(n, 16, 16).float()).reshape(data.shape[0], in_features)
