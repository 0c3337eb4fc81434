"""Each vector unit's code path of the C kernels, built on this machine and checked against float64.

``-march=native`` builds one path: AVX-512 tiles on an AVX-512 CPU, AVX2 tiles on an AVX2 one.
The others would go untested until a machine of that kind ran the suite, so this module builds
the library again with ``-mno-avx512f`` (the AVX2 tiles) and with ``-mno-avx512f -mno-avx2
-mno-fma`` (the generic vector path, whose tiles are the AVX-512 ones' shape), swaps it in for
the backends, and runs the linear and paged extend kernels through their usual launchers. The
AVX-512 tiles themselves run only where the CPU has AVX-512 (the native build there).
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Iterator

import pytest
import torch
from support.kernels import assert_close, cpu_flags, make_paged_context, naive_paged_extend

from loraplex.kernels.cpu import build
from loraplex.kernels.cpu.linear import has_register_tile, linear_packed, pack_weight, panel_width
from loraplex.kernels.cpu.paged_extend import max_row_vectors, paged_extend_cpu, worth_it

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the -mno-avx* variants are x86 flags"
)


# (name, extra flags, linear panel width, linear register tile, extend row vectors, extend register tile)
VARIANTS = [
    ("avx2", ("-mno-avx512f",), 16, True, 6, True),
    ("generic", ("-mno-avx512f", "-mno-avx2", "-mno-fma"), 64, False, 3, False),
]


@pytest.fixture(scope="module")
def libraries() -> dict[str, ctypes.CDLL]:
    """Each variant's library, loaded once for the module."""
    return {}


@pytest.fixture(params=VARIANTS, ids=[v[0] for v in VARIANTS])
def variant(
    request: pytest.FixtureRequest,
    libraries: dict[str, ctypes.CDLL],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[str, int, bool, int, bool]]:
    name, flags, width, linear_tile, row_vectors, extend_tile = request.param
    if name == "avx2" and not {"avx2", "fma"} <= cpu_flags():
        # Hardware, not a service: an x86 CPU without AVX2 + FMA cannot execute this build
        # (SIGILL). The generic variant and the native build still run there.
        pytest.skip("this CPU lacks AVX2 + FMA: the AVX2 build cannot execute here")
    if name not in libraries:
        compiler = build._compiler()
        assert compiler is not None, "the CPU kernels need a C compiler (./dev installs gcc)"
        # Cached beside the native build, under a name that hashes the flags too: rebuilt only
        # when a source changes (a build takes ~10 s per variant).
        target = build.library_path(compiler, flags)
        if not target.exists():
            build.build(compiler, target, flags)
        libraries[name] = ctypes.CDLL(str(target))
    library = libraries[name]
    build.clear_caches()
    monkeypatch.setattr(build, "load_library", lambda: library)
    try:
        yield name, width, linear_tile, row_vectors, extend_tile
    finally:
        monkeypatch.undo()
        build.clear_caches()


def test_the_variant_reports_its_tiles(variant: tuple[str, int, bool, int, bool]) -> None:
    _, width, linear_tile, row_vectors, extend_tile = variant
    assert panel_width() == width
    assert has_register_tile() is linear_tile
    assert max_row_vectors() == row_vectors
    assert worth_it() is extend_tile


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 32, 97])
def test_linear(variant: tuple[str, int, bool, int, bool], m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    for n, k in [(17, 9), (65, 576), (960, 576)]:
        x = torch.randn(m, k, generator=gen)
        w = torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen)
        y = linear_packed(x, pack_weight(w), b, n)
        expected = x.double() @ w.double().t() + b.double()
        torch.testing.assert_close(y.double(), expected, atol=1e-4 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("head_dim", "gqa"), [(64, 3), (128, 1), (72, 4)])
def test_paged_extend(
    variant: tuple[str, int, bool, int, bool], dtype: torch.dtype, head_dim: int, gqa: int
) -> None:
    gen = torch.Generator().manual_seed(head_dim + gqa)
    query_lens, contexts = [37, 5, 32, 1], [37, 5 + 19, 32 + 300, 1 + 48]
    ctx = make_paged_context(contexts, 16, 2, head_dim, dtype, torch.device("cpu"), gen)
    query = torch.randn(sum(query_lens), gqa * 2, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, 37, 42, 74, 75], dtype=torch.int32)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    scale = head_dim**-0.5
    expected = naive_paged_extend(query, ctx, query_lens, contexts, scale)
    for row_vectors in range(variant[3] + 1):
        out = paged_extend_cpu(
            query,
            ctx.k_cache,
            ctx.v_cache,
            ctx.block_tables,
            seq_lens,
            starts,
            scale,
            max_row_vectors=row_vectors,
        )
        assert_close(out, expected, dtype, f"{variant[0]} extend, {row_vectors} row vectors")


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "f16", "bf16", "int8"])
def test_quant_linear(variant: tuple[str, int, bool, int, bool], name: str) -> None:
    from support.kernels import random_packed

    from loraplex.kernels.cpu.quant_linear import qlinear

    gen = torch.Generator().manual_seed(len(name))
    k = 512 if name in ("q4_k", "q6_k") else 96
    for m, n, plan in [(1, 7, "direct"), (3, 66, "direct"), (13, 67, "panels"), (5, 130, "auto")]:
        packed = random_packed(name, n, k, gen)
        x = torch.randn(m, k, generator=gen)
        b = torch.randn(n, generator=gen)
        expected = x.double() @ packed.dequantize().double().t() + b.double()
        y = qlinear(x, packed, b, plan)
        scale = expected.abs().max().item()
        torch.testing.assert_close(y.double(), expected, atol=1e-5 * scale * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("name", ["q8_0x16", "q4_0x16", "q4_1x16", "q8_0x16a8", "q4_0x16a8", "q4_1x16a8"])
def test_interleaved_quant_linear(variant: tuple[str, int, bool, int, bool], name: str) -> None:
    """The interleaved formats' integer dot products (GCC vectors without VNNI) and panels."""
    from support.kernels import random_packed

    from loraplex.kernels.cpu.quant_linear import qlinear
    from loraplex.kernels.formats.interleaved import Interleaved, quantize_activations

    gen = torch.Generator().manual_seed(len(name))
    for m, n, k, plan in [
        (1, 16, 96, "direct"),
        (3, 48, 576, "auto"),
        (4, 32, 64, "direct"),
        (13, 80, 96, "panels"),
        (13, 32, 64, "auto"),
    ]:
        packed = random_packed(name, n, k, gen)
        assert isinstance(packed.format, Interleaved)
        x = torch.randn(m, k, generator=gen)
        b = torch.randn(n, generator=gen)
        xs = quantize_activations(x, packed.format.activation_bits) if plan != "panels" else x
        expected = xs.double() @ packed.dequantize().double().t() + b.double()
        y = qlinear(x, packed, b, plan)
        scale = expected.abs().max().item()
        torch.testing.assert_close(y.double(), expected, atol=1e-5 * scale * k**0.5, rtol=1e-5)


def test_amx_needs_the_avx512_build(variant: tuple[str, int, bool, int, bool]) -> None:
    """Builds without AVX-512 have no AMX kernels: "auto" never picks them, and asking for the
    plan is an error, not a wrong answer."""
    from support.kernels import random_packed

    from loraplex.kernels.cpu.quant_linear import has_amx, qlinear

    assert not has_amx()
    # int8 x: past AMX's 64 rows, and integer at any number of rows on every build
    packed = random_packed("q4_1x16a8", 32, 64, torch.Generator().manual_seed(1))
    x = torch.randn(80, 64)
    with pytest.raises(RuntimeError, match="quantized linear failed"):
        qlinear(x, packed, None, "amx")
    assert torch.equal(qlinear(x, packed, None, "auto"), qlinear(x, packed, None, "direct"))
