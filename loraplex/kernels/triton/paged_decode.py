"""Paged decode attention: one new query token per sequence over its block table.

One program serves one (sequence, KV head) pair and the whole query group that
shares that KV head (GQA), so each K/V row is read from memory once per group, not
once per query head. Context tokens are processed in tiles of ``BLOCK_N`` tokens
that may span several pages (each token looks its page up in the block table), so
a page size of 8 still feeds ``tl.dot`` tiles of >= 16 tokens.

Long contexts with few (sequence, KV head) pairs would leave most SMs idle, so a
split-K variant partitions the context: each partition writes its running max,
sum and unnormalised output, and a second kernel rescales and reduces them. The
split is chosen by ``choose_num_splits`` from the batch size and context length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.metadata import check_block_tables, first_visible_block
from loraplex.kernels.triton.common import (
    SUPPORTED_DTYPES,
    device_sms,
    dot_f32,
    dot_precision,
    needs_upcast,
    pow2_at_least,
    soft_cap_log2,
)

LOG2E = 1.4426950408889634

# Below this context length one program per (sequence, KV head) finishes quickly
# enough that a second (reduce) launch costs more than the idle SMs.
MIN_SPLIT_CONTEXT = 1024
# Each partition keeps at least this many tokens, so a split is worth its partials.
MIN_PARTITION_TOKENS = 256
MAX_SPLITS = 64


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many context partitions each (sequence, KV head) program is split into.

    Aims for about two waves of programs on the device: no split when the batch
    alone fills it or the context is short; otherwise as many partitions as the
    idle SMs can take, each at least ``MIN_PARTITION_TOKENS`` long.
    """
    programs = num_seqs * num_kv_heads
    if max_seq_len < MIN_SPLIT_CONTEXT or programs >= num_sms:
        return 1
    wanted = -(-2 * num_sms // programs)
    by_length = max_seq_len // MIN_PARTITION_TOKENS
    return max(1, min(wanted, by_length, MAX_SPLITS))


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    max_ptr,
    sum_ptr,
    scale_log2,
    softcap,
    window,
    partition_size,
    stride_q_seq,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    stride_o_seq,
    stride_o_head,
    stride_o_split,
    stride_m_seq,
    stride_m_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    end = tl.minimum(part * partition_size + partition_size, seq_len)
    # A sliding window (window > 0) sees keys seq_len - window ..: earlier table entries may
    # be PAD_BLOCK_ID, so loads start there (window = 0: from key 0).
    first_key = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    start = tl.maximum(part * partition_size, first_key)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        block_ids = tl.load(block_tables_ptr + seq * stride_bt_seq + pos // PAGE_SIZE, mask=valid, other=0)
        slots = pos % PAGE_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache_ptr
            + block_ids.to(tl.int64)[:, None] * stride_k_block
            + slots[:, None] * stride_k_slot
            + kv_head * stride_k_head
            + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + block_ids.to(tl.int64)[:, None] * stride_v_block
            + slots[:, None] * stride_v_slot
            + kv_head * stride_v_head
            + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        # Scores in the log2 domain so the softmax uses exp2.
        s = dot_f32(q, tl.trans(k), UPCAST, PRECISION) * scale_log2
        if SOFTCAP:
            s = soft_cap_log2(s, softcap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot_f32(p.to(v.dtype), v, UPCAST, PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    out_offs = seq * stride_o_seq + heads[:, None] * stride_o_head + part * stride_o_split + offs_d[None, :]
    if SPLIT:
        # Partials stay unnormalised: an empty partition has l == 0 and m == -inf,
        # which the reduce weights to exactly 0 without dividing here.
        tl.store(out_ptr + out_offs, acc, mask=out_mask)
        m_offs = seq * stride_m_seq + heads * stride_m_head + part
        tl.store(max_ptr + m_offs, m_i, mask=g_mask)
        tl.store(sum_ptr + m_offs, l_i, mask=g_mask)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    partial_ptr,
    max_ptr,
    sum_ptr,
    out_ptr,
    num_splits,
    stride_p_seq,
    stride_p_head,
    stride_p_split,
    stride_m_seq,
    stride_m_head,
    stride_o_seq,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    m_offs = seq * stride_m_seq + head * stride_m_head + offs_s
    m = tl.load(max_ptr + m_offs, mask=s_mask, other=float("-inf"))
    l_part = tl.load(sum_ptr + m_offs, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - m_max)  # exp2(-inf) == 0 for empty or padded partitions
    partial = tl.load(
        partial_ptr
        + seq * stride_p_seq
        + head * stride_p_head
        + offs_s[:, None] * stride_p_split
        + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(weight * l_part, 0)
    out = tl.sum(partial * weight[:, None], 0) / total
    tl.store(
        out_ptr + seq * stride_o_seq + head * stride_o_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, each >= 1
    scale: float,
    max_seq_len: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Decode attention of one query token per sequence over its paged context.

    s[i, h, t] = (q[i, h] . K[table[i][t // B], t % B, h // group]) * scale,  t < seq_lens[i]
    p[i, h, :] = softmax(s[i, h, :])            (online, fp32, split-K when long)
    out[i, h]  = sum_t p[i, h, t] * V[table[i][t // B], t % B, h // group]

    Entries of ``block_tables[i]`` past ``ceil(seq_lens[i] / B)`` are ``PAD_BLOCK_ID``
    and never loaded (table loads are masked by ``t < seq_lens[i]``). Used entries are
    checked for padding only when the table is on the host (the interpreter): on the
    GPU the check would cost a device sync per call.

    ``sliding_window`` W: the query sees keys ``seq_lens[i] - W ..`` only and the loads
    start there (entries before may be padding); ``logit_softcap`` c: ``s = c tanh(s / c)``
    on the scaled scores.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, page_size, num_kv_heads, kv_dim = k_cache.shape
    assert query.dtype in SUPPORTED_DTYPES, f"query dtype {query.dtype} not supported"
    assert query.stride(2) == 1, "query rows must be contiguous in head_dim"
    assert kv_dim == head_dim, f"cache head_dim {kv_dim} != query head_dim {head_dim}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} KV heads"
    assert k_cache.dtype == query.dtype and v_cache.dtype == query.dtype, "cache and query dtypes differ"
    assert v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache rows must be contiguous in head_dim"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, "block_tables is [num_seqs, *]"
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1, "block_tables: contiguous int32"
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32, "seq_lens is [num_seqs] int32"
    assert max_seq_len <= block_tables.shape[1] * page_size, "max_seq_len exceeds the block table"
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(2) == 1, "out is [num_seqs, num_heads, head_dim]"
    if num_seqs == 0:
        return out
    if block_tables.device.type == "cpu":
        lens = seq_lens.tolist()
        firsts = [first_visible_block(n - 1, sliding_window, page_size) for n in lens]
        check_block_tables(block_tables, lens, page_size, firsts)

    group = num_heads // num_kv_heads
    head_dim_pad = pow2_at_least(head_dim)
    block_n = 64 if head_dim_pad <= 128 else 32
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, device_sms(query.device))
    partition_size = -(-max(1, max_seq_len) // num_splits)
    partition_size = -(-partition_size // block_n) * block_n  # whole tiles per partition
    num_splits = max(1, -(-max_seq_len // partition_size))
    common = {
        "GROUP": group,
        "GROUP_PAD": pow2_at_least(group),
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": head_dim_pad,
        "PAGE_SIZE": page_size,
        "BLOCK_N": block_n,
        "UPCAST": needs_upcast(query.dtype),
        "PRECISION": dot_precision(query.dtype),
        "SOFTCAP": bool(logit_softcap),
        "num_warps": 4,
    }
    window_args = (float(logit_softcap or 0.0), int(sliding_window or 0))
    scale_log2 = scale * LOG2E
    grid = (num_seqs, num_kv_heads, num_splits)
    kv_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    if num_splits == 1:
        _paged_decode_kernel[grid](
            query, k_cache, v_cache, block_tables, seq_lens, out, out, out,
            scale_log2, *window_args, partition_size, query.stride(0), query.stride(1), *kv_strides,
            block_tables.stride(0), out.stride(0), out.stride(1), 0, 0, 0,
            SPLIT=False, **common,
        )  # fmt: skip
        return out

    partial = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    maxes = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    sums = torch.empty_like(maxes)
    _paged_decode_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, partial, maxes, sums,
        scale_log2, *window_args, partition_size, query.stride(0), query.stride(1), *kv_strides,
        block_tables.stride(0), partial.stride(0), partial.stride(1), partial.stride(2),
        maxes.stride(0), maxes.stride(1),
        SPLIT=True, **common,
    )  # fmt: skip
    _paged_decode_reduce_kernel[(num_seqs, num_heads)](
        partial, maxes, sums, out, num_splits,
        partial.stride(0), partial.stride(1), partial.stride(2), maxes.stride(0), maxes.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=pow2_at_least(num_splits, 2),
        num_warps=4,
    )  # fmt: skip
    return out
