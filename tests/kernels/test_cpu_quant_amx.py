"""The AMX kernels of the interleaved formats (``quant_amx.c``) against their references.

float x (gguf: ``q*x16``) is held to x itself, the de-quantized weights and float64 (x and the
weights each carried as two bf16 halves: within 2^-17 of float32 per value), and must come closer
to it than the int16 blocks of the integer kernel; int8 x (gguf_a8: ``q*x16a8``) to x quantized as
llama.cpp does, as the integer kernel. The shapes walk the kernel's edges: a last tile of rows past
m, an odd number of 16-row groups (the float kernel takes groups in pairs), block counts that are
not a multiple of a segment (6 blocks), and more rows than one pass over the weights keeps in L2
(448 rows of k = 576, 160 of k = 1,536).

These run only on a CPU with AMX (Intel Xeon since Sapphire Rapids) and a kernel that grants it:
elsewhere the engine never takes this path, and ``test_cpu_isa_variants`` checks that a build
without AVX-512 refuses the plan.
"""

from __future__ import annotations

import pytest
import torch
from support.kernels import random_packed

from loraplex.kernels.cpu.quant_linear import amx_min_m, c_kernel, has_amx, qlinear
from loraplex.kernels.formats.interleaved import Interleaved, quantize_activations

pytestmark = [
    pytest.mark.skipif(c_kernel() is None, reason="no C compiler"),
    # Hardware, not a service: without AMX-INT8 / AMX-BF16 (or the kernel's permission) the
    # tile instructions cannot execute here; "auto" then never picks this plan.
    pytest.mark.skipif(c_kernel() is not None and not has_amx(), reason="this CPU has no usable AMX"),
]

INTERLEAVED = ["q8_0x16", "q4_0x16", "q4_1x16", "q8_0x16a8", "q4_0x16a8", "q4_1x16a8"]
SHAPES = [  # (m, n, k)
    (1, 16, 32),
    (16, 16, 32),  # one group: the float kernel's pair has a single member
    (17, 48, 96),  # a pair and a single group; a tile with one row
    (32, 32, 192),  # six blocks: one segment exactly
    (33, 80, 224),  # seven blocks: a segment and one block
    (130, 64, 576),
    (470, 32, 576),  # two passes of rows (448 + 22)
    (200, 48, 1536),  # two passes of rows (160 + 40)
]


def reference(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    fmt = packed.format
    assert isinstance(fmt, Interleaved)
    xs = quantize_activations(x, 8) if fmt.int8_activations else x
    expected = xs.double() @ packed.dequantize().double().t()
    return expected + bias.double() if bias is not None else expected


@pytest.mark.parametrize("name", INTERLEAVED)
def test_amx_against_the_reference(name: str) -> None:
    for m, n, k in SHAPES:
        gen = torch.Generator().manual_seed(m * n + k)
        packed = random_packed(name, n, k, gen)
        x = torch.randn(m, k, generator=gen)
        x[0, :32] = 0.0  # an all-zero block (int8: scale 0)
        bias = torch.randn(n, generator=gen) if m % 2 else None
        y = qlinear(x, packed, bias, "amx")
        expected = reference(x, packed, bias)
        scale = expected.abs().max().item() + 1e-3
        # float x: 2^-17 per value, 2e-6 to 6e-6 of the largest output seen (2e-5 allowed; the
        # integer kernels' bound is 1e-5 * sqrt(k) of it)
        atol = 2e-5 * scale if not name.endswith("a8") else 1e-5 * scale * k**0.5
        torch.testing.assert_close(y.double(), expected, atol=atol, rtol=0), (name, m, n, k)


@pytest.mark.parametrize("name", ["q8_0x16", "q4_1x16"])
def test_amx_float_x_is_closer_to_float_than_the_int16_blocks(name: str) -> None:
    """gguf's contract is int16-block activations or better: the bf16 halves are better."""
    gen = torch.Generator().manual_seed(21)
    packed = random_packed(name, 192, 576, gen)
    x = torch.randn(64, 576, generator=gen) * torch.linspace(0.1, 10.0, 576)  # outlier channels
    exact = reference(x, packed, None)

    def err(plan: str) -> float:
        return (qlinear(x, packed, None, plan).double() - exact).abs().max().item()

    assert err("amx") < err("direct") / 2, (err("amx"), err("direct"))


def test_amx_strided_rows_equal_contiguous_ones() -> None:
    gen = torch.Generator().manual_seed(22)
    packed = random_packed("q4_1x16", 48, 64, gen)
    big = torch.randn(40, 100, generator=gen)
    x = big[:, 10:74]  # row stride 100
    assert torch.equal(qlinear(x, packed, None, "amx"), qlinear(x.contiguous(), packed, None, "amx"))


@pytest.mark.parametrize("name", ["q4_1x16", "q8_0x16a8"])
def test_amx_non_finite_activations_stay_in_their_rows(name: str) -> None:
    """A NaN or inf in one row of x gives that row non-finite outputs; the rows beside it, in
    the same tile, stay exact."""
    gen = torch.Generator().manual_seed(23)
    packed = random_packed(name, 32, 64, gen)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(40, 64, generator=gen)
        x[5, 40] = bad
        y = qlinear(x, packed, None, "amx")
        assert not torch.isfinite(y[5]).any()
        keep = [i for i in range(40) if i != 5]
        torch.testing.assert_close(y[keep], qlinear(x[keep], packed, None, "amx"))


def test_auto_takes_amx_from_its_threshold() -> None:
    """Float x from 32 rows (below, unpacking a group to bf16 costs more than the tiles save),
    int8 x from 64 (below, the VNNI kernel is as fast): benchmarks/quant_kernels.py."""
    gen = torch.Generator().manual_seed(24)
    for name, threshold in (("q8_0x16a8", 64), ("q4_1x16", 32)):
        packed = random_packed(name, 32, 96, gen)
        assert isinstance(packed.format, Interleaved)
        assert amx_min_m(packed.format) == threshold
        for m in (threshold - 1, threshold):
            x = torch.randn(m, 96, generator=gen)
            plan = "amx" if m >= threshold else "direct"
            assert torch.equal(qlinear(x, packed, None, "auto"), qlinear(x, packed, None, plan)), (name, m)


def test_amx_from_two_threads_at_once() -> None:
    """Tile configuration and state are per OS thread: two callers at once (two engines in one
    process) each get their own products."""
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(25)
    jobs = []
    for name in ("q4_1x16", "q8_0x16a8"):
        packed = random_packed(name, 96, 576, gen)
        x = torch.randn(200, 576, generator=gen)
        jobs.append((x, packed, qlinear(x, packed, None, "amx")))
    with ThreadPoolExecutor(max_workers=2) as pool:
        for _ in range(3):
            futures = [pool.submit(qlinear, x, packed, None, "amx") for x, packed, _ in jobs]
            for future, (_, _, expected) in zip(futures, jobs, strict=True):
                assert torch.equal(future.result(), expected)
