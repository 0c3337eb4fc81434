"""Packed weights for the quantized-kernel tests: random but well-formed blocks of every format."""

from __future__ import annotations

import torch

from loraplex.kernels.contracts import PackedWeight
from loraplex.kernels.formats import FORMATS

# Byte offsets of the float16 fields of each block format (set to sane values in random blocks).
F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q6_k": (208,)}


def random_packed(name: str, rows: int, in_features: int, gen: torch.Generator) -> PackedWeight:
    """A ``rows x in_features`` weight in format ``name``: quantized from Gaussian floats where
    the format quantizes, else random bytes with small float16 scales."""
    fmt = FORMATS[name]  # type: ignore[index]
    w = torch.randn(rows, in_features, generator=gen) * 0.05
    if name not in ("q4_k", "q6_k"):
        return PackedWeight(fmt, fmt.quantize(w), in_features)
    data = torch.randint(0, 256, (rows, fmt.row_bytes(in_features)), generator=gen, dtype=torch.uint8)
    blocks = data.view(-1, fmt.block_bytes)
    for offset in F16_FIELDS[name]:
        scale = (torch.rand(blocks.shape[0], 1, generator=gen) * 0.01 + 1e-3).half()
        blocks[:, offset : offset + 2] = scale.view(torch.uint8)
    return PackedWeight(fmt, data, in_features)
