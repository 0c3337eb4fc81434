"""The C quantized projection against the torch reference (dequantize, then float64 matmul),
over every format, both plans (in-register and decoded panels) and odd shapes."""

from __future__ import annotations

import pytest
import torch
from quant_testlib import random_packed

from loraplex.kernels.cpu.quant_linear import c_kernel, qlinear

pytestmark = pytest.mark.skipif(c_kernel() is None, reason="no C compiler")

FORMATS = ["q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "f16", "bf16", "f32", "int8"]


def check(name: str, m: int, n: int, k: int, plan: str, bias: bool, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    packed = random_packed(name, n, k, gen)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    y = qlinear(x, packed, b, plan)
    expected = x.double() @ packed.dequantize().double().t()
    if b is not None:
        expected += b.double()
    scale = expected.abs().max().item() + 1e-3
    torch.testing.assert_close(y.double(), expected, atol=1e-5 * scale * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("plan", ["direct", "panels", "auto"])
def test_formats_and_plans(name: str, plan: str) -> None:
    k = 512 if name in ("q4_k", "q6_k") else 96
    for m, n in [(1, 7), (3, 64), (5, 130), (13, 67)]:
        check(name, m, n, k, plan, bias=m % 2 == 1, seed=m * n)


@pytest.mark.parametrize("name", ["q4_1", "q8_0"])
def test_model_shapes(name: str) -> None:
    for m, n, k in [(1, 960, 576), (2, 576, 1536), (37, 3072, 576), (1, 4099, 576)]:
        check(name, m, n, k, "auto", bias=False, seed=n)


def test_strided_rows_and_empty() -> None:
    gen = torch.Generator().manual_seed(5)
    packed = random_packed("q4_1", 40, 64, gen)
    big = torch.randn(3, 100, generator=gen)
    x = big[:, 10:74]  # row stride 100
    torch.testing.assert_close(qlinear(x, packed, None), qlinear(x.contiguous(), packed, None))
    assert qlinear(torch.empty(0, 64), packed, None).shape == (0, 40)
