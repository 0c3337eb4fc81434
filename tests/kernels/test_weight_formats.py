"""The weight formats' torch references give the floats GGUF's own reader gives (``gguf.quants``),
their quantizers the bytes ggml's do, and packed rows survive the loader's row surgery."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_testlib import random_packed

from loraplex.kernels.contracts import PackedWeight
from loraplex.kernels.formats import FORMATS

gguf = pytest.importorskip("gguf")

GGML = {
    "q8_0": "Q8_0",
    "q4_0": "Q4_0",
    "q4_1": "Q4_1",
    "q4_k": "Q4_K",
    "q6_k": "Q6_K",
    "f16": "F16",
    "bf16": "BF16",
    "f32": "F32",
}


@pytest.mark.parametrize("name", sorted(GGML))
def test_dequantize_equals_gguf(name: str) -> None:
    gen = torch.Generator().manual_seed(len(name))
    in_features = 512 if name in ("q4_k", "q6_k") else 96
    packed = random_packed(name, 7, in_features, gen)
    qtype = getattr(gguf.GGMLQuantizationType, GGML[name])
    expected = gguf.quants.dequantize(packed.data.numpy(), qtype)
    got = packed.dequantize()
    assert got.dtype == torch.float32 and got.shape == (7, in_features)
    assert np.array_equal(got.numpy(), expected.reshape(7, in_features)), name


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1", "bf16"])
def test_quantize_equals_gguf(name: str) -> None:
    w = torch.randn(5, 128, generator=torch.Generator().manual_seed(1)) * 0.1
    qtype = getattr(gguf.GGMLQuantizationType, GGML[name])
    expected = gguf.quants.quantize(w.numpy(), qtype)
    assert np.array_equal(FORMATS[name].quantize(w).numpy(), expected), name  # type: ignore[index]


def test_int8_per_channel_round_trip() -> None:
    w = torch.randn(9, 48, generator=torch.Generator().manual_seed(2))
    packed = PackedWeight(FORMATS["int8"], FORMATS["int8"].quantize(w), 48)
    back = packed.dequantize()
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert (back - w).abs().le(step / 2 + 1e-6).all()
    assert packed.nbytes == 9 * (48 + 4)


def test_rows_and_shape_checks() -> None:
    gen = torch.Generator().manual_seed(3)
    packed = random_packed("q4_1", 10, 64, gen)
    idx = torch.tensor([3, 0, 9, 3])
    assert torch.equal(packed.rows(idx), packed.dequantize()[idx])
    with pytest.raises(ValueError, match="multiple"):
        FORMATS["q8_0"].row_bytes(33)
    with pytest.raises(ValueError, match="take"):
        PackedWeight(FORMATS["q8_0"], packed.data, 64)
