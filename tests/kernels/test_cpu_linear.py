"""The C packed-panel linear kernel against float64 math, and its backend's fallbacks."""

from __future__ import annotations

import pytest
import torch
from support.kernels import cpu_flags

from loraplex.kernels.cpu import build
from loraplex.kernels.cpu.linear import (
    CpuLinearBackend,
    has_register_tile,
    linear_packed,
    pack_weight,
    panel_width,
)
from loraplex.kernels.portable.linear import PortableLinearBackend
from loraplex.kernels.registry import select_linear_backend

CPU = torch.device("cpu")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


# Rows: empty, under one 6-row tile, one tile, a tile + 1, around a 96-row work item.
# Columns: one, under / at / over one panel (16 columns with AVX2, 64 with AVX-512), SmolLM2's qkv.
# Depth: 1, odd, 576.
@pytest.mark.parametrize("m", [0, 1, 5, 6, 7, 95, 96, 97, 200])
@pytest.mark.parametrize(
    ("n", "k"), [(1, 7), (15, 2), (16, 9), (17, 33), (63, 1), (64, 33), (65, 576), (960, 576)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_float64(m: int, n: int, k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    packed = pack_weight(w)
    assert packed.shape == (-(-n // panel_width()), k, panel_width())
    y = linear_packed(x, packed, b, n)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _reference(x, w, b), atol=1e-4 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("m", [12, 13, 32, 50, 96])
def test_few_panels_split_rows_between_threads(m: int, threads: int) -> None:
    """9 panels (SmolLM2's o / down width) on 2-4 threads: each panel's rows are split into two
    items; every row and column must still be written once, with the next panel prefetched."""
    gen = torch.Generator().manual_seed(m * 10 + threads)
    x = torch.randn(m, 1536, generator=gen)
    w = torch.randn(576, 1536, generator=gen)
    b = torch.randn(576, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = linear_packed(x, pack_weight(w), b, 576)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(y.double(), _reference(x, w, b), atol=1e-4 * 1536**0.5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_strided_rows_and_thread_counts(threads: int) -> None:
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(130, 700, generator=gen)
    x = big[:, 50:626]  # rows with a stride of 700
    w = torch.randn(300, 576, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = linear_packed(x, pack_weight(w), None, 300)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(y.double(), _reference(x, w, None), atol=1e-3, rtol=1e-5)
    # Columns must be contiguous: a transposed x is copied, not misread.
    xt = torch.randn(576, 9, generator=gen).t()
    torch.testing.assert_close(
        linear_packed(xt, pack_weight(w), None, 300).double(), _reference(xt, w, None), atol=1e-3, rtol=1e-5
    )


def test_backend_packs_float32_and_leaves_other_dtypes_to_torch() -> None:
    backend = CpuLinearBackend()
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(70, 40, generator=gen)
    x = torch.randn(3, 40, generator=gen)
    prepared = backend.prepare(w)
    assert prepared.dim() == 3  # packed panels
    torch.testing.assert_close(backend(x, prepared, None, 70), x @ w.t())
    w16 = w.to(torch.bfloat16)
    assert backend.prepare(w16) is w16  # bf16 stays with F.linear (oneDNN)
    torch.testing.assert_close(
        backend(x.bfloat16(), w16, None, 70), torch.nn.functional.linear(x.bfloat16(), w16)
    )


def test_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    # "auto" takes the C kernel where it builds with a register tile (AVX-512, or AVX2 + FMA).
    auto_is_c = isinstance(select_linear_backend("auto", CPU), CpuLinearBackend)
    assert auto_is_c == has_register_tile()
    flags = cpu_flags()
    if "avx512f" in flags or {"avx2", "fma"} <= flags:
        assert auto_is_c
    assert isinstance(select_linear_backend("cpu", CPU), CpuLinearBackend)  # forced: anywhere it builds
    assert type(select_linear_backend("torch", CPU)) is PortableLinearBackend
    assert select_linear_backend("auto", torch.device("cuda")).name == "triton"  # packed weights; F.linear
    with pytest.raises(ValueError, match="unknown linear backend"):
        select_linear_backend("cublas", CPU)  # type: ignore[arg-type]
    monkeypatch.setenv(build.ENV_SWITCH, "0")
    build.clear_caches()
    try:
        assert type(select_linear_backend("auto", CPU)) is PortableLinearBackend
        with pytest.raises(ValueError, match="'cpu' linear backend needs"):
            select_linear_backend("cpu", CPU)
    finally:
        build.clear_caches()
