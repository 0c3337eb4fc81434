"""The Triton quantized projection against the torch reference (dequantize, float64 matmul),
over every format, odd shapes, float32 and bfloat16 activations (the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from support.kernels import random_packed

from loraplex.kernels.registry import select_linear_backend, weight_format
from loraplex.kernels.triton.quant_linear import supports, triton_qlinear

FORMATS = ["q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "f16", "bf16", "f32", "int8"]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("name", FORMATS)
def test_formats(name: str) -> None:
    gen = torch.Generator().manual_seed(len(name) * 7)
    k = 512 if name in ("q4_k", "q6_k") else 96
    for m, n, bias in [(1, 7, True), (17, 70, False), (3, 64, True)]:
        packed = random_packed(name, n, k, gen).to(DEVICE)
        x = torch.randn(m, k, generator=gen)
        b = torch.randn(n, generator=gen) if bias else None
        expected = x.double() @ packed.to(torch.device("cpu")).dequantize().double().t()
        if b is not None:
            expected += b.double()
        y = triton_qlinear(x.to(DEVICE), packed, None if b is None else b.to(DEVICE))
        scale = expected.abs().max().item()
        torch.testing.assert_close(y.cpu().double(), expected, atol=1e-5 * scale * k**0.5, rtol=1e-5)


def test_bfloat16_activations_and_backend() -> None:
    gen = torch.Generator().manual_seed(9)
    packed = random_packed("q4_1", 40, 64, gen).to(DEVICE)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    assert supports(packed, x.to(DEVICE))
    expected = x.float() @ packed.to(torch.device("cpu")).dequantize().t()
    backend = select_linear_backend("triton", DEVICE)
    y = backend(x.to(DEVICE), packed, None, 40)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.cpu().float(), expected, atol=0.05, rtol=0.02)
    w = torch.randn(40, 64, generator=gen)  # float weights: F.linear
    torch.testing.assert_close(backend(x.float().to(DEVICE), w.to(DEVICE), None, 40).cpu(), x.float() @ w.t())


def test_weight_format_registry() -> None:
    assert weight_format("q4_1").block_bytes == 20
    with pytest.raises(ValueError, match="unknown weight format"):
        weight_format("q5_1")
