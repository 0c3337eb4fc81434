"""The compiled C paged decode kernel (``loraplex/kernels/cpu``) vs naive math and the portable path.

Same grid axes as the Triton decode tests: block sizes 8/16/32, head dims 64/128,
GQA ratios 1/3/4, contexts of 1 token, one block, one past a boundary, a partial
last block and over 1,000 tokens, mixed in one batch. float32 and bfloat16 (the
kernel's types; float16 goes to the portable path, checked through the backend).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from support.kernels import assert_close, make_paged_context, naive_paged_decode

from loraplex.kernels.cpu import build
from loraplex.kernels.cpu.attention import CpuAttentionBackend
from loraplex.kernels.cpu.paged_decode import paged_decode_cpu, supports
from loraplex.kernels.portable.attention import PortableAttentionBackend
from loraplex.kernels.portable.lora import PortableLoRABackend
from loraplex.kernels.portable.paged_decode import paged_decode
from loraplex.kernels.registry import select_attention_backend, select_lora_backend

CPU = torch.device("cpu")
KERNEL_DTYPES = (torch.float32, torch.bfloat16)

FAST_CASES = [(8, 64, 1, 2), (16, 128, 3, 1), (32, 64, 4, 2)]
SLOW_CASES = list(itertools.product((8, 16, 32), (64, 128), (1, 3, 4), (1, 3)))


def _check(
    block_size: int, head_dim: int, gqa: int, num_kv_heads: int, dtype: torch.dtype, long_len: int
) -> None:
    gen = torch.Generator().manual_seed(block_size * 997 + head_dim * 31 + gqa * 7 + num_kv_heads)
    lens = [1, block_size, block_size + 1, 3 * block_size - 2, long_len]
    ctx = make_paged_context(lens, block_size, num_kv_heads, head_dim, dtype, CPU, gen)
    query = torch.randn(len(lens), gqa * num_kv_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    assert supports(query, ctx.k_cache)
    out = paged_decode_cpu(query, ctx.k_cache, ctx.v_cache, ctx.block_tables, seq_lens, scale)
    assert_close(out, naive_paged_decode(query, ctx, scale), dtype, "C paged decode vs naive")
    reference = paged_decode(query, ctx.k_cache, ctx.v_cache, ctx.block_tables, seq_lens, scale)
    assert_close(out, reference.double(), dtype, "C paged decode vs portable")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", FAST_CASES, ids=lambda c: "bs{}-d{}-gqa{}-kv{}".format(*c))
def test_c_paged_decode(case: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    _check(*case, dtype, long_len=1029)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: "bs{}-d{}-gqa{}-kv{}".format(*c))
def test_c_paged_decode_grid(case: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    _check(*case, dtype, long_len=1500)


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_c_paged_decode_thread_counts_agree(threads: int) -> None:
    """Work is split differently with more threads (fewer heads per item); results must not move."""
    gen = torch.Generator().manual_seed(3)
    lens = [700, 5, 64]
    ctx = make_paged_context(lens, 16, 4, 64, torch.float32, CPU, gen)
    query = torch.randn(3, 8, 64, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = paged_decode_cpu(query, ctx.k_cache, ctx.v_cache, ctx.block_tables, seq_lens, 0.125)
    finally:
        torch.set_num_threads(before)
    assert_close(out, naive_paged_decode(query, ctx, 0.125), torch.float32, f"{threads} threads")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_c_paged_decode_reads_query_rows_in_place(dtype: torch.dtype) -> None:
    """The query may be the q part of fused qkv rows (a row stride wider than its heads): read
    in place, with the same result as a contiguous copy and the output contiguous."""
    gen = torch.Generator().manual_seed(17)
    lens = [3, 40, 17]
    ctx = make_paged_context(lens, 16, 2, 64, dtype, CPU, gen)
    qkv = torch.randn(len(lens), (6 + 2 * 2) * 64, generator=gen).to(dtype)
    query = qkv[:, : 6 * 64].view(len(lens), 6, 64)
    assert not query.is_contiguous()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_cpu(query, ctx.k_cache, ctx.v_cache, ctx.block_tables, seq_lens, 0.125)
    assert out.is_contiguous()
    expected = paged_decode_cpu(
        query.contiguous(), ctx.k_cache, ctx.v_cache, ctx.block_tables, seq_lens, 0.125
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert_close(out, naive_paged_decode(query.contiguous(), ctx, 0.125), dtype, "strided query vs naive")


def test_c_paged_decode_rejects_bad_tables_and_lengths() -> None:
    gen = torch.Generator().manual_seed(4)
    ctx = make_paged_context([20, 9], 8, 1, 64, torch.float32, CPU, gen)
    query = torch.randn(2, 2, 64, generator=gen)
    num_blocks = ctx.k_cache.shape[0]
    bad_table = ctx.block_tables.clone()
    bad_table[1, 0] = num_blocks  # one past the pool: must not be read
    with pytest.raises(ValueError, match="block id outside"):
        paged_decode_cpu(
            query, ctx.k_cache, ctx.v_cache, bad_table, torch.tensor([20, 9], dtype=torch.int32), 1.0
        )
    with pytest.raises(ValueError, match="seq_len < 1"):
        paged_decode_cpu(
            query, ctx.k_cache, ctx.v_cache, ctx.block_tables, torch.tensor([20, 0], dtype=torch.int32), 1.0
        )


def test_float16_and_wide_groups_fall_back_to_torch() -> None:
    k_cache = torch.zeros(4, 16, 1, 64, dtype=torch.float16)
    assert not supports(torch.zeros(2, 4, 64, dtype=torch.float16), k_cache)
    wide = torch.zeros(4, 16, 1, 256)
    assert not supports(torch.zeros(2, 64, 256), wide)  # a 64-head group of dim 256: too big for one item


def test_registry_picks_c_kernels_on_cpu_unless_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(select_attention_backend("auto", CPU), CpuAttentionBackend)
    assert type(select_attention_backend("torch", CPU)) is PortableAttentionBackend
    monkeypatch.setenv(build.ENV_SWITCH, "0")
    build.clear_caches()
    try:
        assert type(select_attention_backend("auto", CPU)) is PortableAttentionBackend
        assert type(select_lora_backend("auto", CPU)) is PortableLoRABackend
        with pytest.raises(ValueError, match="'cpu' attention backend needs"):
            select_attention_backend("cpu", CPU)
    finally:
        build.clear_caches()


def test_build_reports_compiler_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken compiler is a warning and a torch fallback, never an exception at start-up."""
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path))
    build.clear_caches()
    try:
        assert build.load_library() is None
        assert type(select_attention_backend("auto", CPU)) is PortableAttentionBackend
    finally:
        build.clear_caches()
