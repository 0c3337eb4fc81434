"""The weight formats' torch references give the floats GGUF's own reader gives (``gguf.quants``),
their quantizers the bytes ggml's do, and packed rows survive the loader's row surgery."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.kernels import random_packed

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


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1"])
def test_interleaved_layout_round_trips(name: str) -> None:
    """The 16-row interleaved layouts: same bytes, the same floats, rows read through the groups."""
    from loraplex.kernels.formats.interleaved import Interleaved

    base = FORMATS[name]  # type: ignore[index]
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(48, 96, generator=gen)
    raw = base.quantize(w)
    for suffix in ("x16", "x16a8"):
        fmt = FORMATS[f"{name}{suffix}"]  # type: ignore[index]
        assert isinstance(fmt, Interleaved) and fmt.block_bytes == base.block_bytes
        data = fmt.interleave(raw, 96)
        assert data.shape == raw.shape and not torch.equal(data, raw)
        assert torch.equal(fmt.deinterleave(data, 96), raw)
        packed = PackedWeight(fmt, data, 96)
        assert torch.equal(packed.dequantize(), PackedWeight(base, raw, 96).dequantize())
        index = torch.tensor([0, 17, 47, 3, 17])
        assert torch.equal(packed.rows(index), PackedWeight(base, raw, 96).rows(index))
        # byte layout of group 0, block 0: the 16 rows' d, then chunk 0 = 4 bytes of each row
        assert torch.equal(
            data[0, :32].view(torch.float16), raw[:16, :2].contiguous().view(torch.float16)[:, 0]
        )
        head = 4 if name == "q4_1" else 2
        chunk0 = data.reshape(-1)[16 * head : 16 * head + 64].reshape(16, 4)  # group 0, block 0
        expected = raw[:16, head : head + 4] ^ (0x80 if name == "q8_0" else 0)
        assert torch.equal(chunk0, expected)
    with pytest.raises(ValueError, match="multiple"):
        FORMATS[f"{name}x16"].interleave(raw[:40], 96)  # type: ignore[index]
