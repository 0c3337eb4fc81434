"""The C quantized projection against the torch reference (dequantize, then float64 matmul),
over every format, both plans (in-register and decoded panels) and odd shapes."""

from __future__ import annotations

import pytest
import torch
from support.kernels import random_packed

from loraplex.kernels.contracts import PackedWeight
from loraplex.kernels.cpu.quant_linear import c_kernel, qlinear
from loraplex.kernels.formats import FORMATS as ALL_FORMATS
from loraplex.kernels.formats.interleaved import Interleaved

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


INTERLEAVED = ["q8_0x16", "q4_0x16", "q4_1x16", "q8_0x16a8", "q4_0x16a8", "q4_1x16a8"]


def auto_path(fmt: Interleaved, m: int, plan: str = "auto") -> str:
    """What ``plan`` runs for ``m`` rows of x: "direct" (the integer dot products), "panels"
    (exact floats), "amx" (the tile unit, x in bf16 halves: held to x itself) or "amx_a8"
    (the tile unit, int8 x: the same integers as "direct")."""
    from loraplex.kernels.cpu.quant_linear import amx_min_m, has_amx, x16_direct_max_m

    if plan == "auto" and has_amx() and m >= (amx_min_m(fmt) or m + 1):
        plan = "amx"
    if plan == "amx":
        return "amx_a8" if fmt.int8_activations else "amx"
    limit_m = x16_direct_max_m(fmt)  # "auto" past it: the exact panels
    integer = plan == "direct" or (plan == "auto" and (limit_m is None or m <= limit_m))
    return "direct" if integer else "panels"


def check_interleaved(name: str, m: int, n: int, k: int, plan: str, bias: bool, seed: int = 0) -> None:
    """An interleaved format against its reference: x quantized as the kernel does (exact
    floats for the panels plan), then a float64 matmul."""
    from loraplex.kernels.formats.interleaved import quantize_activations

    gen = torch.Generator().manual_seed(seed)
    packed = random_packed(name, n, k, gen)
    fmt = packed.format
    assert isinstance(fmt, Interleaved)
    x = torch.randn(m, k, generator=gen)
    x[0, :32] = 0.0  # an all-zero block (scale 0)
    b = torch.randn(n, generator=gen) if bias else None
    y = qlinear(x, packed, b, plan)
    integer = auto_path(fmt, m, plan) in ("direct", "amx_a8")
    xs = quantize_activations(x, fmt.activation_bits) if integer else x
    expected = xs.double() @ packed.dequantize().double().t()
    if b is not None:
        expected += b.double()
    scale = expected.abs().max().item() + 1e-3
    torch.testing.assert_close(y.double(), expected, atol=1e-5 * scale * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("name", INTERLEAVED)
@pytest.mark.parametrize("plan", ["direct", "panels", "auto"])
def test_interleaved_formats_and_plans(name: str, plan: str) -> None:
    for m, n, k in [
        (1, 16, 32),
        (2, 48, 96),
        (3, 64, 160),
        (4, 16, 64),
        (5, 80, 96),
        (7, 144, 64),
        (33, 32, 96),
    ]:
        check_interleaved(name, m, n, k, plan, bias=m % 2 == 1, seed=m * n + k)


@pytest.mark.parametrize("name", ["q4_1x16", "q8_0x16", "q4_1x16a8"])
def test_interleaved_model_shapes(name: str) -> None:
    for m, n, k in [
        (1, 960, 576),
        (2, 576, 1536),
        (4, 3072, 576),
        (37, 576, 1536),
        (1, 4096, 576),
        (130, 64, 576),
    ]:
        check_interleaved(name, m, n, k, "auto", bias=False, seed=n)


@pytest.mark.parametrize("name", ["q4_1x16", "q8_0x16", "q4_1x16a8", "q8_0x16a8"])
def test_auto_plan_by_rows(name: str) -> None:
    """The "auto" plan: AMX from ``amx_min_m`` rows where the CPU has it; else the integer one
    up to ``x16_direct_max_m`` rows (any number with VNNI, and with int8 x: llama.cpp's
    arithmetic) and the exact panels past it."""
    from loraplex.kernels.cpu.build import limit
    from loraplex.kernels.cpu.quant_linear import x16_direct_max_m

    gen = torch.Generator().manual_seed(5)
    packed = random_packed(name, 48, 576, gen)
    assert isinstance(packed.format, Interleaved)
    limit_m = x16_direct_max_m(packed.format)
    vnni = bool(limit("loraplex_qx16_has_vnni"))
    assert limit_m == (None if vnni or name.endswith("a8") else 32)
    for m in (1, 15, 16, 31, 32, 33, 70):
        x = torch.randn(m, 576, generator=gen)
        path = auto_path(packed.format, m)
        expected = qlinear(x, packed, None, {"amx_a8": "amx"}.get(path, path))
        assert torch.equal(qlinear(x, packed, None, "auto"), expected), (name, m, path)


def test_int16_activations_stay_close_to_float() -> None:
    """gguf's int16 activations: within ~1e-4 of the float product (what keeps HF's tokens)."""
    gen = torch.Generator().manual_seed(3)
    packed = random_packed("q4_1x16", 960, 576, gen)
    x = torch.randn(1, 576, generator=gen)
    exact = x.double() @ packed.dequantize().double().t()
    y16 = qlinear(x, packed, None)
    y8 = qlinear(x, PackedWeight(ALL_FORMATS["q4_1x16a8"], packed.data, 576), None)  # same blocks, int8 x
    err16 = (y16.double() - exact).abs().max().item() / exact.abs().max().item()
    err8 = (y8.double() - exact).abs().max().item() / exact.abs().max().item()
    assert err16 < 1e-4 < err8, (err16, err8)


def test_interleave_keeps_other_formats_and_odd_rows() -> None:
    from loraplex.kernels.cpu.quant_linear import interleave

    gen = torch.Generator().manual_seed(4)
    odd = random_packed("q4_1", 40, 64, gen)
    assert interleave(odd) is odd  # 40 rows: not whole groups of 16
    k_quant = random_packed("q6_k", 32, 256, gen)
    assert interleave(k_quant) is k_quant
    q8 = random_packed("q8_0", 32, 64, gen)
    assert interleave(q8).format.name == "q8_0x16"
    assert interleave(q8, int8_activations=True).format.name == "q8_0x16a8"
    assert torch.equal(interleave(q8).dequantize(), q8.dequantize())


@pytest.mark.parametrize("name", INTERLEAVED)
def test_interleaved_rows_in_c(name: str) -> None:
    from loraplex.kernels.cpu.quant_linear import rows

    gen = torch.Generator().manual_seed(11)
    packed = random_packed(name, 64, 96, gen)
    index = torch.tensor([0, 15, 16, 63, 15, 40])
    assert torch.equal(rows(packed, index), packed.rows(index))
    with pytest.raises(IndexError):
        rows(packed, torch.tensor([64]))


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1"])
def test_interleave_in_place_equals_the_reference(name: str) -> None:
    from loraplex.kernels.cpu.quant_linear import interleave

    gen = torch.Generator().manual_seed(12)
    plain = random_packed(name, 48, 160, gen)
    expected = interleave(plain)  # the torch reference, a new tensor
    data = plain.data.clone()
    done = interleave(PackedWeight(plain.format, data, 160), in_place=True)
    assert done.data.data_ptr() == data.data_ptr() and done.format is expected.format
    assert torch.equal(done.data, expected.data)


@pytest.mark.parametrize("name", ["q4_1x16", "q8_0x16a8"])
def test_interleaved_non_finite_activations_stay_non_finite(name: str) -> None:
    """A NaN or inf in x gives non-finite outputs (the engine's check sees them), not garbage."""
    gen = torch.Generator().manual_seed(13)
    packed = random_packed(name, 32, 64, gen)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 64, generator=gen)
        x[1, 40] = bad
        y = qlinear(x, packed, None)
        assert torch.isfinite(y[0]).all() and not torch.isfinite(y[1]).any()
