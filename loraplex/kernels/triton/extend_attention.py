"""Prefill / extend attention: a chunk of new queries over its paged prefix and itself.

For a ragged batch (``query_start_loc``, ``seq_lens``, block tables) each program
serves ``BLOCK_M`` consecutive query rows of one sequence and one query head. The
new tokens' K/V are already in the cache (``write_kv`` runs first), so the kernel
reads the whole context, prefix and chunk alike, through the block table, with a
causal mask offset by the cached prefix length. A program stops reading at the
last key its last row may see, so tiles past the diagonal are never loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.metadata import check_block_tables, first_visible_block
from loraplex.kernels.triton.common import (
    SUPPORTED_DTYPES,
    dot_f32,
    dot_precision,
    needs_upcast,
    pow2_at_least,
    soft_cap_log2,
)

LOG2E = 1.4426950408889634


@triton.jit
def _extend_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    softcap,
    window,
    seq_offset,
    stride_q_tok,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    stride_o_tok,
    stride_o_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq = seq_offset + tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix = seq_len - q_len
        kv_head = head // GROUP

        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_mask = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + (q_start + rows)[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
            mask=row_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        # Key position of each query row; padded rows copy the last real row's limit.
        q_pos = prefix + tl.minimum(rows, q_len - 1)
        kv_end = prefix + tl.minimum(q_len, (m_block + 1) * BLOCK_M)
        # A sliding window (window > 0): the tile's first row sees keys from
        # prefix + m_block * BLOCK_M - window + 1 on; table entries before may be PAD_BLOCK_ID.
        kv_start = tl.where(window > 0, tl.maximum(prefix + m_block * BLOCK_M - window + 1, 0), 0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        for n0 in range(kv_start, kv_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < kv_end
            table_row = block_tables_ptr + seq * stride_bt_seq
            block_ids = tl.load(table_row + pos // PAGE_SIZE, mask=valid, other=0)
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
            s = dot_f32(q, tl.trans(k), UPCAST, PRECISION) * scale_log2
            if SOFTCAP:
                s = soft_cap_log2(s, softcap)
            visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            visible = visible & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Under a window a row may see no key of a tile (max -inf): subtract 0 then, so
            # exp2 gives 0, not NaN (without one every row sees key 0 of the first tile).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + dot_f32(p.to(v.dtype), v, UPCAST, PRECISION)
            m_i = m_new

        out = acc / l_i[:, None]
        tl.store(
            out_ptr + (q_start + rows)[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )


def extend_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], the flat batch
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, cached prefix + new tokens
    scale: float,
    max_query_len: int,
    first_seq: int = 0,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of sequences ``first_seq..`` over their paged context.

    ``sliding_window`` W: row j sees keys ``prefix + j - W + 1 .. prefix + j`` and a tile's
    loads start at its first row's first key (table entries before may be padding);
    ``logit_softcap`` c: ``s = c tanh(s / c)`` on the scaled scores.

    Rows of sequences before ``first_seq`` (the decodes) are left untouched in ``out``.

    prefix     = seq_lens[i] - query_len(i);  row j of sequence i sits at prefix + j
    s[j, t]    = q[j] . K_i[t] * scale  for t <= prefix + j, else -inf
    out[j]     = softmax(s[j]) @ V_i     (online, fp32; GQA: head h reads h // group)

    Entries of ``block_tables[i]`` past ``ceil(seq_lens[i] / block_size)`` are
    ``PAD_BLOCK_ID`` and never loaded (table loads are masked by position < seq_len).
    Used entries are checked for padding only when the table is on the host (the
    interpreter): on the GPU the check would cost a device sync per call.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, page_size, num_kv_heads, kv_dim = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert query.dtype in SUPPORTED_DTYPES, f"query dtype {query.dtype} not supported"
    assert query.stride(2) == 1, "query rows must be contiguous in head_dim"
    assert kv_dim == head_dim, f"cache head_dim {kv_dim} != query head_dim {head_dim}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} KV heads"
    assert k_cache.dtype == query.dtype and v_cache.dtype == query.dtype, "cache and query dtypes differ"
    assert v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache rows must be contiguous in head_dim"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, "block_tables is [num_seqs, *]"
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1, "block_tables: contiguous int32"
    assert query_start_loc.shape == (num_seqs + 1,), "query_start_loc is [num_seqs + 1]"
    assert query_start_loc.dtype == torch.int32, "query_start_loc must be int32"
    assert seq_lens.dtype == torch.int32, "seq_lens must be int32"
    assert 0 <= first_seq <= num_seqs, f"first_seq {first_seq} outside 0..{num_seqs}"
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(2) == 1, "out is [num_tokens, num_heads, head_dim]"
    if first_seq == num_seqs or num_tokens == 0 or max_query_len == 0:
        return out
    if block_tables.device.type == "cpu":
        lens = seq_lens[first_seq:].tolist()
        q_lens = (query_start_loc[first_seq + 1 :] - query_start_loc[first_seq:-1]).tolist()
        firsts = [
            first_visible_block(n - q, sliding_window, page_size) for n, q in zip(lens, q_lens, strict=True)
        ]
        check_block_tables(block_tables[first_seq:], lens, page_size, firsts)

    head_dim_pad = pow2_at_least(head_dim)
    block_m = 64 if max_query_len > 32 else pow2_at_least(max_query_len)
    block_n = 64 if head_dim_pad <= 128 else 32
    grid = (num_seqs - first_seq, num_heads, triton.cdiv(max_query_len, block_m))
    _extend_attention_kernel[grid](
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E, float(logit_softcap or 0.0), int(sliding_window or 0), first_seq,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=needs_upcast(query.dtype), PRECISION=dot_precision(query.dtype), SOFTCAP=bool(logit_softcap),
        num_warps=8 if head_dim_pad >= 128 else 4,  # a 64 x 128 fp32 accumulator needs the registers
    )  # fmt: skip
    return out
