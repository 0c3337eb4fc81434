"""The compiled C paged extend kernel (prefill chunks over paged KV) vs naive math and the portable path.

Batches mix sequences with no cached prefix (a fresh prefill), a prefix that ends
inside a block, a long prefix with a short chunk (a prefix-cache hit) and single
tokens after a prefix; block sizes 8/16/32, head dims 64/128, GQA 1/3/4/8 and every
tile width the kernel has (``max_row_vectors`` 1-3 of 16 floats with AVX-512, 1-6 of 8 with
AVX2). float32 and bfloat16.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from support.kernels import PagedContext, assert_close, cpu_flags, make_paged_context, naive_paged_extend

from loraplex.kernels.cpu.attention import CpuAttentionBackend
from loraplex.kernels.cpu.paged_extend import max_row_vectors, paged_extend_cpu, supports
from loraplex.kernels.metadata import AttentionMetadata
from loraplex.kernels.portable.attention import PortableAttentionBackend

CPU = torch.device("cpu")
KERNEL_DTYPES = (torch.float32, torch.bfloat16)

# (block_size, head_dim, gqa, num_kv_heads)
FAST_CASES = [(16, 64, 3, 3), (8, 128, 1, 2), (32, 64, 4, 2), (16, 64, 8, 1)]
SLOW_CASES = list(itertools.product((8, 16, 32), (64, 128), (1, 3, 4), (1, 2)))


def _batch(block_size: int) -> tuple[list[int], list[int]]:
    """(query lengths, context lengths): fresh prefill, mid-block prefix, long hit, 1 token, exact blocks."""
    query_lens = [37, 19, 32, 1, 2 * block_size]
    contexts = [37, 19 + block_size + 3, 32 + 1024, 1 + 5 * block_size, 4 * block_size]
    return query_lens, contexts


def _inputs(
    block_size: int, head_dim: int, gqa: int, num_kv_heads: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, PagedContext, torch.Tensor, torch.Tensor, list[int], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    query_lens, contexts = _batch(block_size)
    ctx = make_paged_context(contexts, block_size, num_kv_heads, head_dim, dtype, CPU, gen)
    query = torch.randn(sum(query_lens), gqa * num_kv_heads, head_dim, generator=gen).to(dtype)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return (
        query,
        ctx,
        torch.tensor(contexts, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        query_lens,
        contexts,
    )


def _check(case: tuple[int, int, int, int], dtype: torch.dtype, row_vectors: int) -> None:
    block_size, head_dim, gqa, num_kv_heads = case
    seed = block_size * 131 + head_dim * 7 + gqa * 3 + num_kv_heads + row_vectors
    query, ctx, seq_lens, starts, query_lens, contexts = _inputs(
        block_size, head_dim, gqa, num_kv_heads, dtype, seed
    )
    assert supports(query, ctx.k_cache)
    scale = head_dim**-0.5
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
    expected = naive_paged_extend(query, ctx, query_lens, contexts, scale)
    assert_close(out, expected, dtype, f"C extend ({row_vectors} row vectors)")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("row_vectors", [0, 1, 2, 3, 4, 5, 6], ids=lambda n: f"nv{n}")
@pytest.mark.parametrize("case", FAST_CASES, ids=lambda c: "bs{}-d{}-gqa{}-kv{}".format(*c))
def test_c_paged_extend(case: tuple[int, int, int, int], row_vectors: int, dtype: torch.dtype) -> None:
    # Above the library's most, the kernel takes its most: still a valid (repeated) case.
    _check(case, dtype, row_vectors)


def test_the_library_reports_its_tile_width() -> None:
    assert max_row_vectors() in (3, 6)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: "bs{}-d{}-gqa{}-kv{}".format(*c))
def test_c_paged_extend_grid(case: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    for row_vectors in range(max_row_vectors() + 1):
        _check(case, dtype, row_vectors)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=["float32", "bfloat16"])
def test_c_paged_extend_reads_query_rows_in_place(dtype: torch.dtype) -> None:
    """The query may be the q part of fused qkv rows (row stride wider than its heads): read
    in place, bit for bit the contiguous copy's result."""
    query, ctx, seq_lens, starts, query_lens, contexts = _inputs(16, 64, 3, 3, dtype, 23)
    qkv = torch.cat([query.flatten(1), torch.randn(query.shape[0], 6 * 64).to(dtype)], dim=1)
    strided = qkv[:, : query.shape[1] * 64].view(query.shape)
    assert not strided.is_contiguous()
    out = paged_extend_cpu(strided, ctx.k_cache, ctx.v_cache, ctx.block_tables, seq_lens, starts, 0.125)
    expected = paged_extend_cpu(query, ctx.k_cache, ctx.v_cache, ctx.block_tables, seq_lens, starts, 0.125)
    assert out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert_close(
        out, naive_paged_extend(query, ctx, query_lens, contexts, 0.125), dtype, "strided query vs naive"
    )


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_c_paged_extend_thread_counts_agree(threads: int) -> None:
    """More threads pick narrower tiles (more items); the result must not move."""
    query, ctx, seq_lens, starts, query_lens, contexts = _inputs(16, 64, 3, 3, torch.float32, 11)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = paged_extend_cpu(query, ctx.k_cache, ctx.v_cache, ctx.block_tables, seq_lens, starts, 0.125)
    finally:
        torch.set_num_threads(before)
    assert_close(
        out, naive_paged_extend(query, ctx, query_lens, contexts, 0.125), torch.float32, f"{threads} threads"
    )


def test_c_paged_extend_refuses_bad_tables_and_offsets() -> None:
    query, ctx, seq_lens, starts, _, _ = _inputs(16, 64, 1, 1, torch.float32, 5)
    k, v, table = ctx.k_cache, ctx.v_cache, ctx.block_tables
    bad_table = table.clone()
    bad_table[2, 10] = -1  # PAD_BLOCK_ID inside sequence 2's 66 used blocks
    with pytest.raises(ValueError, match="block id outside"):
        paged_extend_cpu(query, k, v, bad_table, seq_lens, starts, 1.0)
    bad_table[2, 10] = k.shape[0]  # one past the pool
    with pytest.raises(ValueError, match="block id outside"):
        paged_extend_cpu(query, k, v, bad_table, seq_lens, starts, 1.0)
    short = seq_lens.clone()
    short[0] = 5  # 37 query tokens in a context of 5
    with pytest.raises(ValueError, match="above the context"):
        paged_extend_cpu(query, k, v, table, short, starts, 1.0)
    past = starts.clone()
    past[-1] = query.shape[0] + 1  # reaches past the batch
    with pytest.raises(ValueError, match="outside the batch"):
        paged_extend_cpu(query, k, v, table, seq_lens, past, 1.0)


def test_unsupported_shapes_fall_back() -> None:
    cache = torch.zeros(4, 16, 1, 64)
    assert not supports(torch.zeros(2, 4, 64, dtype=torch.float16), cache.half())
    assert not supports(torch.zeros(2, 97, 64), torch.zeros(4, 16, 1, 64))  # a 97-head group
    assert not supports(torch.zeros(2, 2, 68), torch.zeros(4, 16, 1, 68))  # head_dim not a multiple of 8


def test_backend_serves_decodes_and_prefills_in_one_batch() -> None:
    """The CPU backend's forward (C decode + C extend) equals the portable backend's."""
    gen = torch.Generator().manual_seed(21)
    query_lens = [1, 1, 40, 7]
    contexts = [9, 300, 40, 7 + 100]
    ctx = make_paged_context(contexts, 16, 2, 64, torch.float32, CPU, gen)
    query = torch.randn(sum(query_lens), 6, 64, generator=gen)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(contexts, dtype=torch.int32),
        block_tables=ctx.block_tables,
        num_decodes=2,
        max_query_len=40,
        max_seq_len=300,
        query_start_loc_cpu=tuple(starts),
        seq_lens_cpu=tuple(contexts),
    )
    fast = CpuAttentionBackend().forward(query, ctx.k_cache, ctx.v_cache, meta, 0.125)
    reference = PortableAttentionBackend().forward(query, ctx.k_cache, ctx.v_cache, meta, 0.125)
    assert_close(fast, reference.double(), torch.float32, "cpu backend vs portable")


def test_the_backend_takes_the_kernel_only_with_register_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built without register tiles for the CPU (neither AVX-512 nor AVX2) the kernel spills
    (several times slower than torch): the CPU backend then serves prefill attention on the
    portable path, with the same result. x86 CPUs with AVX2 or AVX-512 take the kernel."""
    from loraplex.kernels.cpu import paged_extend

    if {"avx2", "fma"} <= cpu_flags() or "avx512f" in cpu_flags():
        assert paged_extend.worth_it()

    calls: list[int] = []
    real = paged_extend.paged_extend_cpu

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(paged_extend, "paged_extend_cpu", counting)
    query, ctx, seq_lens, starts, query_lens, contexts = _inputs(16, 64, 3, 3, torch.float32, 9)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(query.shape[0], dtype=torch.int64),
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_tables=ctx.block_tables,
        num_decodes=0,
        max_query_len=max(query_lens),
        max_seq_len=max(contexts),
        query_start_loc_cpu=tuple(starts.tolist()),
        seq_lens_cpu=tuple(contexts),
    )
    expected = naive_paged_extend(query, ctx, query_lens, contexts, 0.125)
    for tiles in (True, False):
        monkeypatch.setattr(paged_extend, "worth_it", lambda tiles=tiles: tiles)
        calls.clear()
        out = CpuAttentionBackend().forward(query, ctx.k_cache, ctx.v_cache, meta, 0.125)
        assert_close(out, expected, torch.float32, f"backend, register tiles={tiles}")
        assert bool(calls) == tiles
