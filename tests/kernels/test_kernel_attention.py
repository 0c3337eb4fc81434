"""Paged decode (plain and split-K) and extend attention: Triton vs portable (torch) vs naive math.

The Triton kernels run under TRITON_INTERPRET=1 on CPU-only machines (conftest.py).
Context lengths cover 1, exactly one block, a partial last block, a few blocks and
over 1,000 tokens, mixed in one batch; the default grid touches every block size,
head dim, GQA ratio and dtype once, the ``slow`` grid takes their product.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from support.kernels import (
    DTYPES,
    assert_close,
    kernel_device,
    make_paged_context,
    naive_attention,
    naive_gather,
    naive_paged_decode,
)

from loraplex.kernels.portable import extend_attention as portable_extend
from loraplex.kernels.portable import paged_decode as portable_decode
from loraplex.kernels.triton.extend_attention import extend_attention
from loraplex.kernels.triton.paged_decode import choose_num_splits, paged_decode

DEVICE = kernel_device()

# (block_size, head_dim, gqa_ratio, num_kv_heads, dtype): each value of each axis once.
FAST_CASES = [
    (8, 64, 1, 2, torch.float32),
    (16, 128, 3, 1, torch.bfloat16),
    (32, 64, 4, 1, torch.float16),
]
SLOW_CASES = [
    (bs, dim, gqa, 1, DTYPES[i % 3])
    for i, (bs, dim, gqa) in enumerate(itertools.product((8, 16, 32), (64, 128), (1, 3, 4)))
]


def _case_id(case: tuple[int, int, int, int, torch.dtype]) -> str:
    bs, dim, gqa, kv_heads, dtype = case
    return f"bs{bs}-d{dim}-gqa{gqa}-kv{kv_heads}-{str(dtype).removeprefix('torch.')}"


def _decode_lens(block_size: int, long_len: int) -> list[int]:
    # 1 token, exactly one block, one past a block boundary, a partial last block, long.
    return [1, block_size, block_size + 1, 3 * block_size - 2, long_len]


def _check_decode(
    case: tuple[int, int, int, int, torch.dtype], long_len: int, splits: tuple[int, ...]
) -> None:
    block_size, head_dim, gqa, num_kv_heads, dtype = case
    gen = torch.Generator().manual_seed(block_size * 1000 + head_dim + gqa)
    lens = _decode_lens(block_size, long_len)
    ctx = make_paged_context(lens, block_size, num_kv_heads, head_dim, dtype, DEVICE, gen)
    query = torch.randn(len(lens), gqa * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)

    expected = naive_paged_decode(query, ctx, scale)
    reference = portable_decode.paged_decode(
        query, ctx.k_cache, ctx.v_cache, ctx.block_tables, seq_lens, scale
    )
    assert_close(reference, expected, dtype, "portable paged_decode vs naive")
    for num_splits in splits:
        out = paged_decode(
            query,
            ctx.k_cache,
            ctx.v_cache,
            ctx.block_tables,
            seq_lens,
            scale,
            max(lens),
            num_splits=num_splits,
        )
        assert_close(out, expected, dtype, f"triton paged_decode (splits={num_splits}) vs naive")
        assert_close(out, reference.double(), dtype, f"triton paged_decode (splits={num_splits}) vs portable")


@pytest.mark.slow
@pytest.mark.parametrize("case", FAST_CASES, ids=_case_id)
def test_paged_decode(case: tuple[int, int, int, int, torch.dtype]) -> None:
    # 1 = single pass; 3 forces split-K, with empty partitions for the short sequences.
    _check_decode(case, long_len=1030, splits=(1, 3))


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=_case_id)
def test_paged_decode_grid(case: tuple[int, int, int, int, torch.dtype]) -> None:
    _check_decode(case, long_len=300, splits=(1, 2))


def test_portable_paged_decode_chunks_with_workspace() -> None:
    # Many short sequences share a chunk (mixed lengths -> masked), long ones get their own.
    gen = torch.Generator().manual_seed(7)
    lens = [5, 16, 3, 2000, 17, 1, 33, 700]
    ctx = make_paged_context(lens, 16, 2, 64, torch.float32, torch.device("cpu"), gen)
    query = torch.randn(len(lens), 6, 64, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = naive_paged_decode(query, ctx, 0.125)
    workspace = portable_decode.GatherWorkspace()
    for _ in range(2):  # the second call reuses the buffers
        out = portable_decode.paged_decode(
            query, ctx.k_cache, ctx.v_cache, ctx.block_tables, seq_lens, 0.125,
            seq_lens_cpu=tuple(lens), workspace=workspace,
        )  # fmt: skip
        assert_close(out, expected, torch.float32, "portable paged_decode with workspace")


def test_choose_num_splits() -> None:
    # Short contexts and batches that fill the device never split.
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=512, num_sms=132) == 1
    assert choose_num_splits(num_seqs=64, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 1
    # One sequence, 8 KV heads, 32k tokens: 8 programs -> ceil(264 / 8) = 33 partitions.
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 33
    # Partitions keep >= 256 tokens: 2048 tokens allow at most 8.
    assert choose_num_splits(num_seqs=1, num_kv_heads=1, max_seq_len=2048, num_sms=132) == 8


# -- extend / prefill --------------------------------------------------------------------


def _check_extend(case: tuple[int, int, int, int, torch.dtype], chunks: list[tuple[int, int]]) -> None:
    """``chunks``: (cached prefix length, new tokens) per sequence."""
    block_size, head_dim, gqa, num_kv_heads, dtype = case
    gen = torch.Generator().manual_seed(block_size * 7 + head_dim + gqa)
    seq_lens_list = [p + n for p, n in chunks]
    ctx = make_paged_context(seq_lens_list, block_size, num_kv_heads, head_dim, dtype, DEVICE, gen)
    query_lens = [n for _, n in chunks]
    starts = [0, *itertools.accumulate(query_lens)]
    num_heads = gqa * num_kv_heads
    query = torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = head_dim**-0.5

    out = extend_attention(
        query, ctx.k_cache, ctx.v_cache, ctx.block_tables,
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        torch.tensor(seq_lens_list, dtype=torch.int32, device=DEVICE),
        scale, max_query_len=max(query_lens),
    )  # fmt: skip
    for i, seq_len in enumerate(seq_lens_list):
        lo, hi = starts[i], starts[i + 1]
        k = naive_gather(ctx.k_cache, ctx.block_tables[i], seq_len)
        v = naive_gather(ctx.v_cache, ctx.block_tables[i], seq_len)
        expected = naive_attention(query[lo:hi], k, v, scale)
        k_ref = portable_extend.gather_context(ctx.k_cache, ctx.block_tables[i], seq_len)
        v_ref = portable_extend.gather_context(ctx.v_cache, ctx.block_tables[i], seq_len)
        reference = portable_extend.extend_attention(query[lo:hi], k_ref, v_ref, scale)
        assert_close(reference, expected, dtype, f"portable extend_attention seq {i} vs naive")
        assert_close(out[lo:hi], expected, dtype, f"triton extend_attention seq {i} vs naive")


def _extend_chunks(block_size: int, long_prefix: int) -> list[tuple[int, int]]:
    return [
        (0, 1),  # a lone first token
        (0, 17),  # a fresh prompt, no prefix
        (block_size, 5),  # prefix ends on a block boundary
        (block_size + 3, 20),  # prefix ends mid-block, chunk crosses blocks
        (0, 70),  # more rows than one BLOCK_M tile
        (long_prefix, 24),  # a long cached prefix
    ]


@pytest.mark.slow
@pytest.mark.parametrize("case", FAST_CASES, ids=_case_id)
def test_extend_attention(case: tuple[int, int, int, int, torch.dtype]) -> None:
    _check_extend(case, _extend_chunks(case[0], long_prefix=1000))


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=_case_id)
def test_extend_attention_grid(case: tuple[int, int, int, int, torch.dtype]) -> None:
    _check_extend(case, _extend_chunks(case[0], long_prefix=100))


def test_extend_attention_skips_leading_decodes() -> None:
    # first_seq = 2: the two decode rows must be left exactly as they were in ``out``.
    gen = torch.Generator().manual_seed(3)
    chunks = [(9, 1), (4, 1), (5, 18)]
    lens = [p + n for p, n in chunks]
    ctx = make_paged_context(lens, 8, 1, 64, torch.float32, DEVICE, gen)
    query = torch.randn(20, 2, 64, generator=gen).to(DEVICE)
    out = torch.full_like(query, 123.0)
    starts = torch.tensor([0, 1, 2, 20], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    extend_attention(query, ctx.k_cache, ctx.v_cache, ctx.block_tables, starts, seq_lens, 0.125, 18, 2, out)
    assert bool((out[:2] == 123.0).all())
    k = naive_gather(ctx.k_cache, ctx.block_tables[2], lens[2])
    v = naive_gather(ctx.v_cache, ctx.block_tables[2], lens[2])
    assert_close(out[2:], naive_attention(query[2:], k, v, 0.125), torch.float32, "extend after decodes")
