"""LoRA shrink: project tokens into each adapter's rank space, ``x @ A[slot]^T``.

Two kernels over the stacked weights ``lora_a [num_slices, max_loras, max_rank, in]``:

* BGMV (decode): one program per (token, slice), reading that token's adapter row
  block; a GEMV, so no ``tl.dot`` and no minimum tile size.
* SGMV (prefill): one program per (segment, ``BLOCK_M`` rows, slice), where a
  segment is a run of consecutive tokens with one adapter, so ``A[slot]`` is read
  once per tile of tokens and the product runs on tensor cores.

Both have a paged twin (``bgmv_shrink_paged`` / ``sgmv_shrink_paged``) for adapters kept
in pages of ``page_rank`` rows (``adapters/page_pool.py``): a token (BGMV) or segment
(SGMV) carries a row of a page table ``[rows, max_pages]`` (-1 padded) instead of one
slot, and one program computes all of its pages at once: rank row ``r`` of its output
reads row ``r % page_rank`` of page ``pages[r // page_rank]``. So an adapter of any rank
takes one launch, and the output is ``[num_slices, num_tokens, max_pages * page_rank]``.

All four may split the ``in_features`` reduction (split-K) across programs and add the
fp32 partials atomically, for small batches whose few programs would leave most
SMs idle. Output is float32 ``[num_slices, num_tokens, max_rank]``; rows of tokens
without an adapter stay 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.triton.common import (
    SUPPORTED_DTYPES,
    check_page_table,
    device_sms,
    dot_f32,
    dot_precision,
    needs_upcast,
    pow2_at_least,
)


def choose_split_k(num_programs: int, in_features: int, block_k: int, num_sms: int) -> int:
    """Split the reduction so about two waves of programs run, keeping >= 4 tiles each."""
    if num_programs >= num_sms:
        return 1
    by_length = max(1, in_features // (4 * block_k))
    return max(1, min(-(-2 * num_sms // num_programs), by_length, 16))


def _check_shrink_args(
    x: torch.Tensor, lora_a: torch.Tensor, out: torch.Tensor | None, out_rank: int | None = None
) -> torch.Tensor:
    """Check the arguments; ``out`` (made zeroed if None) is ``[S, T, out_rank]``, ``out_rank``
    defaulting to ``max_rank`` (the paged kernels' rows are ``max_pages * page_rank`` wide)."""
    num_tokens, in_features = x.shape
    num_slices, _, page_rank, a_in = lora_a.shape
    max_rank = page_rank if out_rank is None else out_rank
    assert x.dtype in SUPPORTED_DTYPES and lora_a.dtype == x.dtype, f"dtypes {x.dtype} / {lora_a.dtype}"
    assert a_in == in_features, f"lora_a in_features {a_in} != x in_features {in_features}"
    assert x.stride(1) == 1 and lora_a.stride(3) == 1, "x and lora_a rows must be contiguous"
    if out is None:
        out = torch.zeros(num_slices, num_tokens, max_rank, dtype=torch.float32, device=x.device)
    assert out.shape == (num_slices, num_tokens, max_rank), f"out {tuple(out.shape)} is not [S, T, R]"
    assert out.dtype == torch.float32 and out.stride(2) == 1, "out must be float32, rank-contiguous"
    return out


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    token_slots_ptr,
    in_features,
    max_rank,
    k_per_split,
    stride_x_tok,
    stride_a_slice,
    stride_a_lora,
    stride_a_rank,
    stride_o_slice,
    stride_o_tok,
    RANK_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    tok = tl.program_id(0)
    slice_id = tl.program_id(1)
    k_split = tl.program_id(2)
    slot = tl.load(token_slots_ptr + tok)
    if slot >= 0:
        offs_r = tl.arange(0, RANK_PAD)
        r_mask = offs_r < max_rank
        a_base = a_ptr + slice_id * stride_a_slice + slot.to(tl.int64) * stride_a_lora
        k_start = k_split * k_per_split
        k_end = tl.minimum(k_start + k_per_split, in_features)
        acc = tl.zeros([RANK_PAD], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_end
            x = tl.load(x_ptr + tok * stride_x_tok + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(
                a_base + offs_r[:, None] * stride_a_rank + offs_k[None, :],
                mask=r_mask[:, None] & k_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(a * x[None, :], 1)
        out_offs = out_ptr + slice_id * stride_o_slice + tok * stride_o_tok + offs_r
        if SPLIT_K == 1:
            tl.store(out_offs, acc, mask=r_mask)
        else:
            tl.atomic_add(out_offs, acc, mask=r_mask)


def bgmv_shrink(
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [num_slices, max_loras, max_rank, in_features]
    token_slots: torch.Tensor,  # [num_tokens] int32, -1 = no adapter
    out: torch.Tensor | None = None,  # [num_slices, num_tokens, max_rank] float32, zeroed
    split_k: int | None = None,
) -> torch.Tensor:  # [num_slices, num_tokens, max_rank] float32
    """Per-token LoRA shrink (decode batches): each token reads its own adapter.

    for each token t with s = token_slots[t] >= 0, and each slice i:
        out[i, t, :] = A[i, s] @ x[t]              (fp32 accumulation)
    tokens with s == -1 keep out[:, t, :] == 0
    """
    out = _check_shrink_args(x, lora_a, out)
    num_tokens, in_features = x.shape
    num_slices, _, max_rank, _ = lora_a.shape
    assert token_slots.shape == (num_tokens,) and token_slots.dtype == torch.int32, "token_slots [T] int32"
    if num_tokens == 0 or num_slices == 0:
        return out
    rank_pad = pow2_at_least(max_rank, 1)
    block_k = max(16, min(256, 4096 // rank_pad))
    if split_k is None:
        split_k = choose_split_k(num_tokens * num_slices, in_features, block_k, device_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    split_k = triton.cdiv(in_features, k_per_split)
    _bgmv_shrink_kernel[(num_tokens, num_slices, split_k)](
        x, lora_a, out, token_slots, in_features, max_rank, k_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), out.stride(0), out.stride(1),
        RANK_PAD=rank_pad, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    seg_starts_ptr,
    seg_slots_ptr,
    in_features,
    max_rank,
    k_per_split,
    stride_x_tok,
    stride_a_slice,
    stride_a_lora,
    stride_a_rank,
    stride_o_slice,
    stride_o_tok,
    RANK_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    m_block = tl.program_id(1)
    slice_id = tl.program_id(2) // SPLIT_K
    k_split = tl.program_id(2) % SPLIT_K
    slot = tl.load(seg_slots_ptr + seg)
    row_start = tl.load(seg_starts_ptr + seg) + m_block * BLOCK_M
    seg_end = tl.load(seg_starts_ptr + seg + 1)
    if (slot >= 0) & (row_start < seg_end):
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < seg_end
        offs_r = tl.arange(0, RANK_PAD)
        r_mask = offs_r < max_rank
        a_base = a_ptr + slice_id * stride_a_slice + slot.to(tl.int64) * stride_a_lora
        k_start = k_split * k_per_split
        k_end = tl.minimum(k_start + k_per_split, in_features)
        acc = tl.zeros([BLOCK_M, RANK_PAD], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_end
            x = tl.load(
                x_ptr + rows[:, None] * stride_x_tok + offs_k[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            a = tl.load(
                a_base + offs_r[:, None] * stride_a_rank + offs_k[None, :],
                mask=r_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            acc += dot_f32(x, tl.trans(a), UPCAST, PRECISION)
        out_offs = out_ptr + slice_id * stride_o_slice + rows[:, None] * stride_o_tok + offs_r[None, :]
        out_mask = row_mask[:, None] & r_mask[None, :]
        if SPLIT_K == 1:
            tl.store(out_offs, acc, mask=out_mask)
        else:
            tl.atomic_add(out_offs, acc, mask=out_mask)


def sgmv_shrink(
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [num_slices, max_loras, max_rank, in_features]
    seg_starts: torch.Tensor,  # [num_segments + 1] int32, token offsets of runs
    seg_slots: torch.Tensor,  # [num_segments] int32, adapter slot of each run, -1 = none
    max_seg_len: int,
    out: torch.Tensor | None = None,  # [num_slices, num_tokens, max_rank] float32, zeroed
    split_k: int | None = None,
) -> torch.Tensor:  # [num_slices, num_tokens, max_rank] float32
    """Per-segment LoRA shrink (prefill): one adapter per run of consecutive tokens.

    for each segment g with s = seg_slots[g] >= 0, rows = seg_starts[g] : seg_starts[g + 1]:
        out[i, rows, :] = x[rows] @ A[i, s]^T      (tiles of BLOCK_M rows, fp32 acc)
    rows of segments with s == -1 stay 0
    """
    out = _check_shrink_args(x, lora_a, out)
    num_tokens, in_features = x.shape
    num_slices, _, max_rank, _ = lora_a.shape
    num_segments = seg_slots.shape[0]
    assert seg_starts.shape == (num_segments + 1,) and seg_starts.dtype == torch.int32, "seg_starts [G+1]"
    assert seg_slots.dtype == torch.int32, "seg_slots must be int32"
    if num_tokens == 0 or num_segments == 0 or max_seg_len == 0:
        return out
    rank_pad = pow2_at_least(max_rank)
    block_m = 64 if max_seg_len > 32 else pow2_at_least(max_seg_len)
    block_k = 64 if rank_pad <= 64 else 32
    m_blocks = triton.cdiv(max_seg_len, block_m)
    if split_k is None:
        programs = num_segments * m_blocks * num_slices
        split_k = choose_split_k(programs, in_features, block_k, device_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    split_k = triton.cdiv(in_features, k_per_split)
    _sgmv_shrink_kernel[(num_segments, m_blocks, num_slices * split_k)](
        x, lora_a, out, seg_starts, seg_slots, in_features, max_rank, k_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), out.stride(0), out.stride(1),
        RANK_PAD=rank_pad, BLOCK_M=block_m, BLOCK_K=block_k, SPLIT_K=split_k,
        UPCAST=needs_upcast(x.dtype), PRECISION=dot_precision(x.dtype), num_warps=4,
    )  # fmt: skip
    return out


# -- paged: a page table row per token / segment, every page in one program -----------


@triton.jit
def _page_rows(pages_row_ptr, total_rank, RANK_PAD: tl.constexpr, PAGE_RANK: tl.constexpr):
    """Per output rank row ``r``: its page (-1 past the row's pages) and its row within the page."""
    offs_r = tl.arange(0, RANK_PAD)
    page = tl.load(pages_row_ptr + offs_r // PAGE_RANK, mask=offs_r < total_rank, other=-1)
    return offs_r, page, offs_r % PAGE_RANK


@triton.jit
def _bgmv_shrink_paged_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    pages_ptr,
    in_features,
    total_rank,
    k_per_split,
    stride_x_tok,
    stride_a_slice,
    stride_a_page,
    stride_a_rank,
    stride_o_slice,
    stride_o_tok,
    stride_p_row,
    PAGE_RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    tok = tl.program_id(0)
    slice_id = tl.program_id(1)
    k_split = tl.program_id(2)
    pages_row = pages_ptr + tok * stride_p_row
    if tl.load(pages_row) >= 0:  # rows are filled from the front: page 0 missing = no adapter
        offs_r, page, page_row = _page_rows(pages_row, total_rank, RANK_PAD, PAGE_RANK)
        r_mask = page >= 0
        # Row offsets of each rank row's page (pages -1 are masked; 0 keeps the address sane).
        a_rows = (
            a_ptr
            + slice_id * stride_a_slice
            + tl.maximum(page, 0).to(tl.int64) * stride_a_page
            + page_row * stride_a_rank
        )
        k_start = k_split * k_per_split
        k_end = tl.minimum(k_start + k_per_split, in_features)
        acc = tl.zeros([RANK_PAD], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_end
            x = tl.load(x_ptr + tok * stride_x_tok + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(
                a_rows[:, None] + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0
            ).to(tl.float32)
            acc += tl.sum(a * x[None, :], 1)
        out_offs = out_ptr + slice_id * stride_o_slice + tok * stride_o_tok + offs_r
        if SPLIT_K == 1:
            tl.store(out_offs, acc, mask=r_mask)
        else:
            tl.atomic_add(out_offs, acc, mask=r_mask)


def bgmv_shrink_paged(
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [num_slices, num_pages, page_rank, in_features]
    token_pages: torch.Tensor,  # [num_tokens, max_pages] int32, each row's pages first, then -1
    out: torch.Tensor | None = None,  # [num_slices, num_tokens, max_pages * page_rank] float32, zeroed
    split_k: int | None = None,
) -> torch.Tensor:  # [num_slices, num_tokens, max_pages * page_rank] float32
    """Per-token paged LoRA shrink (decode batches): every page of a token's adapter at once.

    for each token t with pages p_0 .. p_{n-1} = token_pages[t] (p_0 == -1: none), slice i, j < n:
        out[i, t, j*P : (j+1)*P] = A[i, p_j] @ x[t]        (fp32 accumulation)
    everything else in out stays 0
    """
    num_tokens, in_features = x.shape
    num_slices, _, page_rank, _ = lora_a.shape
    check_page_table(token_pages, num_tokens, "token_pages")
    total_rank = token_pages.shape[1] * page_rank
    out = _check_shrink_args(x, lora_a, out, total_rank)
    if num_tokens == 0 or num_slices == 0:
        return out
    rank_pad = pow2_at_least(total_rank, 1)
    block_k = max(16, min(256, 4096 // rank_pad))
    if split_k is None:
        split_k = choose_split_k(num_tokens * num_slices, in_features, block_k, device_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    split_k = triton.cdiv(in_features, k_per_split)
    _bgmv_shrink_paged_kernel[(num_tokens, num_slices, split_k)](
        x, lora_a, out, token_pages, in_features, total_rank, k_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), out.stride(0), out.stride(1),
        token_pages.stride(0),
        PAGE_RANK=page_rank, RANK_PAD=rank_pad, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _sgmv_shrink_paged_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    seg_starts_ptr,
    pages_ptr,
    in_features,
    total_rank,
    k_per_split,
    stride_x_tok,
    stride_a_slice,
    stride_a_page,
    stride_a_rank,
    stride_o_slice,
    stride_o_tok,
    stride_p_row,
    PAGE_RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    m_block = tl.program_id(1)
    slice_id = tl.program_id(2) // SPLIT_K
    k_split = tl.program_id(2) % SPLIT_K
    pages_row = pages_ptr + seg * stride_p_row
    row_start = tl.load(seg_starts_ptr + seg) + m_block * BLOCK_M
    seg_end = tl.load(seg_starts_ptr + seg + 1)
    if (tl.load(pages_row) >= 0) & (row_start < seg_end):
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < seg_end
        offs_r, page, page_row = _page_rows(pages_row, total_rank, RANK_PAD, PAGE_RANK)
        r_mask = page >= 0
        a_rows = (
            a_ptr
            + slice_id * stride_a_slice
            + tl.maximum(page, 0).to(tl.int64) * stride_a_page
            + page_row * stride_a_rank
        )
        k_start = k_split * k_per_split
        k_end = tl.minimum(k_start + k_per_split, in_features)
        acc = tl.zeros([BLOCK_M, RANK_PAD], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_end
            x = tl.load(
                x_ptr + rows[:, None] * stride_x_tok + offs_k[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            a = tl.load(a_rows[:, None] + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            acc += dot_f32(x, tl.trans(a), UPCAST, PRECISION)
        out_offs = out_ptr + slice_id * stride_o_slice + rows[:, None] * stride_o_tok + offs_r[None, :]
        out_mask = row_mask[:, None] & r_mask[None, :]
        if SPLIT_K == 1:
            tl.store(out_offs, acc, mask=out_mask)
        else:
            tl.atomic_add(out_offs, acc, mask=out_mask)


def sgmv_shrink_paged(
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [num_slices, num_pages, page_rank, in_features]
    seg_starts: torch.Tensor,  # [num_segments + 1] int32, token offsets of runs
    seg_pages: torch.Tensor,  # [num_segments, max_pages] int32, each run's pages first, then -1
    max_seg_len: int,
    out: torch.Tensor | None = None,  # [num_slices, num_tokens, max_pages * page_rank] float32, zeroed
    split_k: int | None = None,
) -> torch.Tensor:  # [num_slices, num_tokens, max_pages * page_rank] float32
    """Per-segment paged LoRA shrink (prefill): every page of a run's adapter in one tile.

    for each segment g with pages p_0 .. p_{n-1} = seg_pages[g] (p_0 == -1: none),
    rows = seg_starts[g] : seg_starts[g + 1], slice i, j < n:
        out[i, rows, j*P : (j+1)*P] = x[rows] @ A[i, p_j]^T      (tiles of BLOCK_M rows, fp32 acc)
    """
    num_tokens, in_features = x.shape
    num_slices, _, page_rank, _ = lora_a.shape
    num_segments = seg_pages.shape[0]
    check_page_table(seg_pages, num_segments, "seg_pages")
    assert seg_starts.shape == (num_segments + 1,) and seg_starts.dtype == torch.int32, "seg_starts [G+1]"
    total_rank = seg_pages.shape[1] * page_rank
    out = _check_shrink_args(x, lora_a, out, total_rank)
    if num_tokens == 0 or num_segments == 0 or max_seg_len == 0:
        return out
    rank_pad = pow2_at_least(total_rank)
    block_m = 64 if max_seg_len > 32 else pow2_at_least(max_seg_len)
    block_k = 64 if rank_pad <= 64 else 32
    m_blocks = triton.cdiv(max_seg_len, block_m)
    if split_k is None:
        programs = num_segments * m_blocks * num_slices
        split_k = choose_split_k(programs, in_features, block_k, device_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    split_k = triton.cdiv(in_features, k_per_split)
    _sgmv_shrink_paged_kernel[(num_segments, m_blocks, num_slices * split_k)](
        x, lora_a, out, seg_starts, seg_pages, in_features, total_rank, k_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), out.stride(0), out.stride(1),
        seg_pages.stride(0),
        PAGE_RANK=page_rank, RANK_PAD=rank_pad, BLOCK_M=block_m, BLOCK_K=block_k, SPLIT_K=split_k,
        UPCAST=needs_upcast(x.dtype), PRECISION=dot_precision(x.dtype), num_warps=4,
    )  # fmt: skip
    return out
