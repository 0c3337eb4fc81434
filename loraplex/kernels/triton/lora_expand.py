"""LoRA expand: ``y[:, slice] += scale[slot] * x_rank @ B[slot]^T``, in place.

``lora_b [num_slices, max_loras, max_out, max_rank]`` stacks the output slices of
a fused projection (q/k/v or gate/up); slice ``i`` adds into columns
``offset_i : offset_i + size_i`` of ``y``, where sizes may differ (GQA: q is wider
than k and v) and ``max_out`` is the widest. As for shrink there is a per-token
BGMV kernel for decode and a per-segment SGMV kernel (tensor cores) for prefill.

The paged twins (``bgmv_expand_paged`` / ``sgmv_expand_paged``) read the paged shrink's
``[num_slices, num_tokens, max_pages * page_rank]`` rows: rank column ``r`` of a token
(or segment) multiplies row ``r % page_rank`` of page ``pages[r // page_rank]``, scaled by
that page's scale, and one reduction over all columns sums every page's delta.

Each output element belongs to exactly one program, so the read-add-write of ``y``
needs no atomics.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from loraplex.kernels.triton.common import (
    SUPPORTED_DTYPES,
    check_page_table,
    dot_f32,
    dot_precision,
    needs_upcast,
    pow2_at_least,
)


@functools.lru_cache(maxsize=64)
def slice_tensors(slice_sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Device copies of the slices' column offsets and widths, built once per layout."""
    offsets = [sum(slice_sizes[:i]) for i in range(len(slice_sizes))]
    return (
        torch.tensor(offsets, dtype=torch.int32, device=device),
        torch.tensor(slice_sizes, dtype=torch.int32, device=device),
    )


def _check_expand_args(
    y: torch.Tensor,
    x_rank: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    slice_sizes: tuple[int, ...],
    x_rank_width: int | None = None,
) -> None:
    """Check the arguments; ``x_rank`` is ``[S, T, x_rank_width]``, the width defaulting to
    ``max_rank`` (the paged kernels' rows are ``max_pages * page_rank`` wide)."""
    num_slices, max_loras, max_out, page_rank = lora_b.shape
    max_rank = page_rank if x_rank_width is None else x_rank_width
    num_tokens = y.shape[0]
    assert y.dtype in SUPPORTED_DTYPES and lora_b.dtype == y.dtype, f"dtypes {y.dtype} / {lora_b.dtype}"
    assert y.dim() == 2 and y.shape[1] == sum(slice_sizes), f"y {tuple(y.shape)} != [T, {sum(slice_sizes)}]"
    assert y.stride(1) == 1 and lora_b.stride(3) == 1, "y and lora_b rows must be contiguous"
    assert x_rank.shape == (num_slices, num_tokens, max_rank), f"x_rank {tuple(x_rank.shape)} != [S, T, R]"
    assert x_rank.stride(2) == 1, "x_rank must be rank-contiguous"
    assert len(slice_sizes) == num_slices, f"{len(slice_sizes)} slice sizes for {num_slices} slices"
    assert max(slice_sizes, default=0) <= max_out, f"a slice is wider than lora_b's {max_out} rows"
    assert scales.shape == (max_loras,) and scales.dtype == torch.float32, "scales is [max_loras] float32"


@triton.jit
def _bgmv_expand_kernel(
    x_rank_ptr,
    b_ptr,
    y_ptr,
    token_slots_ptr,
    scales_ptr,
    slice_offsets_ptr,
    slice_sizes_ptr,
    max_rank,
    stride_xr_slice,
    stride_xr_tok,
    stride_b_slice,
    stride_b_lora,
    stride_b_out,
    stride_y_tok,
    RANK_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tok = tl.program_id(0)
    slice_id = tl.program_id(1)
    n_start = tl.program_id(2) * BLOCK_N
    slot = tl.load(token_slots_ptr + tok)
    size = tl.load(slice_sizes_ptr + slice_id)
    if (slot >= 0) & (n_start < size):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < size
        offs_r = tl.arange(0, RANK_PAD)
        r_mask = offs_r < max_rank
        xr_row = x_rank_ptr + slice_id * stride_xr_slice + tok * stride_xr_tok
        xr = tl.load(xr_row + offs_r, mask=r_mask, other=0.0)
        b = tl.load(
            b_ptr
            + slice_id * stride_b_slice
            + slot.to(tl.int64) * stride_b_lora
            + offs_n[:, None] * stride_b_out
            + offs_r[None, :],
            mask=n_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        delta = tl.sum(b.to(tl.float32) * xr.to(tl.float32)[None, :], 1) * tl.load(scales_ptr + slot)
        y_offs = y_ptr + tok * stride_y_tok + tl.load(slice_offsets_ptr + slice_id) + offs_n
        y = tl.load(y_offs, mask=n_mask, other=0.0)
        tl.store(y_offs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def bgmv_expand(
    y: torch.Tensor,  # [num_tokens, sum(slice_sizes)], updated in place
    x_rank: torch.Tensor,  # [num_slices, num_tokens, max_rank] (float32 from shrink)
    lora_b: torch.Tensor,  # [num_slices, max_loras, max_out, max_rank]
    scales: torch.Tensor,  # [max_loras] float32
    slice_sizes: tuple[int, ...],
    token_slots: torch.Tensor,  # [num_tokens] int32, -1 = no adapter
) -> None:
    """Per-token LoRA expand (decode batches) into each slice's columns of ``y``.

    for each token t with s = token_slots[t] >= 0, and each slice i (columns o_i : o_i + n_i):
        y[t, o_i : o_i + n_i] += scale[s] * B[i, s, :n_i] @ x_rank[i, t]     (fp32)
    tokens with s == -1 are untouched
    """
    _check_expand_args(y, x_rank, lora_b, scales, slice_sizes)
    num_tokens = y.shape[0]
    num_slices, _, _, max_rank = lora_b.shape
    assert token_slots.shape == (num_tokens,) and token_slots.dtype == torch.int32, "token_slots [T] int32"
    if num_tokens == 0 or num_slices == 0:
        return
    offsets, sizes = slice_tensors(tuple(slice_sizes), y.device)
    rank_pad = pow2_at_least(max_rank, 1)
    block_n = max(16, min(256, 8192 // rank_pad))
    grid = (num_tokens, num_slices, triton.cdiv(max(slice_sizes), block_n))
    _bgmv_expand_kernel[grid](
        x_rank, lora_b, y, token_slots, scales, offsets, sizes, max_rank,
        x_rank.stride(0), x_rank.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), y.stride(0),
        RANK_PAD=rank_pad, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip


@triton.jit
def _sgmv_expand_kernel(
    x_rank_ptr,
    b_ptr,
    y_ptr,
    seg_starts_ptr,
    seg_slots_ptr,
    scales_ptr,
    slice_offsets_ptr,
    slice_sizes_ptr,
    max_rank,
    n_blocks,
    stride_xr_slice,
    stride_xr_tok,
    stride_b_slice,
    stride_b_lora,
    stride_b_out,
    stride_y_tok,
    RANK_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    m_block = tl.program_id(1)
    slice_id = tl.program_id(2) // n_blocks
    n_start = (tl.program_id(2) % n_blocks) * BLOCK_N
    slot = tl.load(seg_slots_ptr + seg)
    size = tl.load(slice_sizes_ptr + slice_id)
    row_start = tl.load(seg_starts_ptr + seg) + m_block * BLOCK_M
    seg_end = tl.load(seg_starts_ptr + seg + 1)
    if (slot >= 0) & (row_start < seg_end) & (n_start < size):
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < seg_end
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < size
        offs_r = tl.arange(0, RANK_PAD)
        r_mask = offs_r < max_rank
        xr = tl.load(
            x_rank_ptr + slice_id * stride_xr_slice + rows[:, None] * stride_xr_tok + offs_r[None, :],
            mask=row_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr
            + slice_id * stride_b_slice
            + slot.to(tl.int64) * stride_b_lora
            + offs_n[:, None] * stride_b_out
            + offs_r[None, :],
            mask=n_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        # x_rank is fp32; round it to the weights' dtype so the product runs on
        # tensor cores (fp32 weights keep fp32 through PRECISION == "ieee").
        delta = dot_f32(xr.to(b.dtype), tl.trans(b), UPCAST, PRECISION) * tl.load(scales_ptr + slot)
        y_offs = (
            y_ptr + rows[:, None] * stride_y_tok + tl.load(slice_offsets_ptr + slice_id) + offs_n[None, :]
        )
        y_mask = row_mask[:, None] & n_mask[None, :]
        y = tl.load(y_offs, mask=y_mask, other=0.0)
        tl.store(y_offs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=y_mask)


def sgmv_expand(
    y: torch.Tensor,  # [num_tokens, sum(slice_sizes)], updated in place
    x_rank: torch.Tensor,  # [num_slices, num_tokens, max_rank] (float32 from shrink)
    lora_b: torch.Tensor,  # [num_slices, max_loras, max_out, max_rank]
    scales: torch.Tensor,  # [max_loras] float32
    slice_sizes: tuple[int, ...],
    seg_starts: torch.Tensor,  # [num_segments + 1] int32
    seg_slots: torch.Tensor,  # [num_segments] int32, -1 = no adapter
    max_seg_len: int,
) -> None:
    """Per-segment LoRA expand (prefill) into each slice's columns of ``y``.

    for each segment g with s = seg_slots[g] >= 0, rows = seg_starts[g] : seg_starts[g + 1]:
        y[rows, o_i : o_i + n_i] += scale[s] * x_rank[i, rows] @ B[i, s, :n_i]^T   (fp32 acc)
    segments with s == -1 are untouched
    """
    _check_expand_args(y, x_rank, lora_b, scales, slice_sizes)
    num_tokens = y.shape[0]
    num_slices, _, _, max_rank = lora_b.shape
    num_segments = seg_slots.shape[0]
    assert seg_starts.shape == (num_segments + 1,) and seg_starts.dtype == torch.int32, "seg_starts [G+1]"
    assert seg_slots.dtype == torch.int32, "seg_slots must be int32"
    if num_tokens == 0 or num_segments == 0 or num_slices == 0 or max_seg_len == 0:
        return
    offsets, sizes = slice_tensors(tuple(slice_sizes), y.device)
    rank_pad = pow2_at_least(max_rank)
    block_m = 64 if max_seg_len > 32 else pow2_at_least(max_seg_len)
    block_n = 64
    n_blocks = triton.cdiv(max(slice_sizes), block_n)
    grid = (num_segments, triton.cdiv(max_seg_len, block_m), num_slices * n_blocks)
    _sgmv_expand_kernel[grid](
        x_rank, lora_b, y, seg_starts, seg_slots, scales, offsets, sizes, max_rank, n_blocks,
        x_rank.stride(0), x_rank.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), y.stride(0),
        RANK_PAD=rank_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=needs_upcast(y.dtype), PRECISION=dot_precision(y.dtype), num_warps=4,
    )  # fmt: skip


# -- paged: every page of a token's / segment's adapter in one reduction -----------------


@triton.jit
def _paged_columns(pages_row_ptr, scales_ptr, total_rank, RANK_PAD: tl.constexpr, PAGE_RANK: tl.constexpr):
    """Per rank column ``r``: its page (0 where none: masked), its row within the page,
    whether it has a page, and that page's scale (0 where none)."""
    offs_r = tl.arange(0, RANK_PAD)
    page = tl.load(pages_row_ptr + offs_r // PAGE_RANK, mask=offs_r < total_rank, other=-1)
    r_mask = page >= 0
    safe_page = tl.maximum(page, 0).to(tl.int64)
    scale = tl.load(scales_ptr + safe_page, mask=r_mask, other=0.0)
    return offs_r, safe_page, offs_r % PAGE_RANK, r_mask, scale


@triton.jit
def _bgmv_expand_paged_kernel(
    x_rank_ptr,
    b_ptr,
    y_ptr,
    pages_ptr,
    scales_ptr,
    slice_offsets_ptr,
    slice_sizes_ptr,
    total_rank,
    stride_xr_slice,
    stride_xr_tok,
    stride_b_slice,
    stride_b_page,
    stride_b_out,
    stride_y_tok,
    stride_p_row,
    PAGE_RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tok = tl.program_id(0)
    slice_id = tl.program_id(1)
    n_start = tl.program_id(2) * BLOCK_N
    pages_row = pages_ptr + tok * stride_p_row
    size = tl.load(slice_sizes_ptr + slice_id)
    if (tl.load(pages_row) >= 0) & (n_start < size):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < size
        offs_r, page, page_row, r_mask, scale = _paged_columns(
            pages_row, scales_ptr, total_rank, RANK_PAD, PAGE_RANK
        )
        xr_row = x_rank_ptr + slice_id * stride_xr_slice + tok * stride_xr_tok
        xr = tl.load(xr_row + offs_r, mask=r_mask, other=0.0).to(tl.float32) * scale
        b = tl.load(
            b_ptr
            + slice_id * stride_b_slice
            + page[None, :] * stride_b_page
            + offs_n[:, None] * stride_b_out
            + page_row[None, :],
            mask=n_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        delta = tl.sum(b.to(tl.float32) * xr[None, :], 1)
        y_offs = y_ptr + tok * stride_y_tok + tl.load(slice_offsets_ptr + slice_id) + offs_n
        y = tl.load(y_offs, mask=n_mask, other=0.0)
        tl.store(y_offs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def bgmv_expand_paged(
    y: torch.Tensor,  # [num_tokens, sum(slice_sizes)], updated in place
    x_rank: torch.Tensor,  # [num_slices, num_tokens, max_pages * page_rank] (from bgmv_shrink_paged)
    lora_b: torch.Tensor,  # [num_slices, num_pages, max_out, page_rank]
    scales: torch.Tensor,  # [num_pages] float32
    slice_sizes: tuple[int, ...],
    token_pages: torch.Tensor,  # [num_tokens, max_pages] int32, each row's pages first, then -1
) -> None:
    """Per-token paged LoRA expand (decode batches): all of a token's pages in one sum.

    for each token t with pages p_0 .. p_{n-1} = token_pages[t] (p_0 == -1: none), slice i:
        y[t, o_i : o_i + n_i] += sum_j scale[p_j] * B[i, p_j, :n_i] @ x_rank[i, t, j*P : (j+1)*P]
    tokens without pages are untouched
    """
    num_tokens = y.shape[0]
    num_slices, _, _, page_rank = lora_b.shape
    check_page_table(token_pages, num_tokens, "token_pages")
    total_rank = token_pages.shape[1] * page_rank
    _check_expand_args(y, x_rank, lora_b, scales, slice_sizes, total_rank)
    if num_tokens == 0 or num_slices == 0:
        return
    offsets, sizes = slice_tensors(tuple(slice_sizes), y.device)
    rank_pad = pow2_at_least(total_rank, 1)
    block_n = max(16, min(256, 8192 // rank_pad))
    grid = (num_tokens, num_slices, triton.cdiv(max(slice_sizes), block_n))
    _bgmv_expand_paged_kernel[grid](
        x_rank, lora_b, y, token_pages, scales, offsets, sizes, total_rank,
        x_rank.stride(0), x_rank.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), y.stride(0),
        token_pages.stride(0),
        PAGE_RANK=page_rank, RANK_PAD=rank_pad, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip


@triton.jit
def _sgmv_expand_paged_kernel(
    x_rank_ptr,
    b_ptr,
    y_ptr,
    seg_starts_ptr,
    pages_ptr,
    scales_ptr,
    slice_offsets_ptr,
    slice_sizes_ptr,
    total_rank,
    n_blocks,
    stride_xr_slice,
    stride_xr_tok,
    stride_b_slice,
    stride_b_page,
    stride_b_out,
    stride_y_tok,
    stride_p_row,
    PAGE_RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    m_block = tl.program_id(1)
    slice_id = tl.program_id(2) // n_blocks
    n_start = (tl.program_id(2) % n_blocks) * BLOCK_N
    pages_row = pages_ptr + seg * stride_p_row
    size = tl.load(slice_sizes_ptr + slice_id)
    row_start = tl.load(seg_starts_ptr + seg) + m_block * BLOCK_M
    seg_end = tl.load(seg_starts_ptr + seg + 1)
    if (tl.load(pages_row) >= 0) & (row_start < seg_end) & (n_start < size):
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < seg_end
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < size
        offs_r, page, page_row, r_mask, scale = _paged_columns(
            pages_row, scales_ptr, total_rank, RANK_PAD, PAGE_RANK
        )
        xr = tl.load(
            x_rank_ptr + slice_id * stride_xr_slice + rows[:, None] * stride_xr_tok + offs_r[None, :],
            mask=row_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr
            + slice_id * stride_b_slice
            + page[None, :] * stride_b_page
            + offs_n[:, None] * stride_b_out
            + page_row[None, :],
            mask=n_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        # Pages may have different scales: scale the rank columns (fp32) before rounding them
        # to the weights' dtype for the tensor-core product, as the portable backend does.
        xr = (xr.to(tl.float32) * scale[None, :]).to(b.dtype)
        delta = dot_f32(xr, tl.trans(b), UPCAST, PRECISION)
        y_offs = (
            y_ptr + rows[:, None] * stride_y_tok + tl.load(slice_offsets_ptr + slice_id) + offs_n[None, :]
        )
        y_mask = row_mask[:, None] & n_mask[None, :]
        y = tl.load(y_offs, mask=y_mask, other=0.0)
        tl.store(y_offs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=y_mask)


def sgmv_expand_paged(
    y: torch.Tensor,  # [num_tokens, sum(slice_sizes)], updated in place
    x_rank: torch.Tensor,  # [num_slices, num_tokens, max_pages * page_rank] (from sgmv_shrink_paged)
    lora_b: torch.Tensor,  # [num_slices, num_pages, max_out, page_rank]
    scales: torch.Tensor,  # [num_pages] float32
    slice_sizes: tuple[int, ...],
    seg_starts: torch.Tensor,  # [num_segments + 1] int32
    seg_pages: torch.Tensor,  # [num_segments, max_pages] int32, each run's pages first, then -1
    max_seg_len: int,
) -> None:
    """Per-segment paged LoRA expand (prefill): all of a run's pages in one tensor-core product.

    for each segment g with pages p_0 .. p_{n-1} = seg_pages[g] (p_0 == -1: none),
    rows = seg_starts[g] : seg_starts[g + 1], slice i:
        y[rows, o_i : o_i + n_i] += sum_j scale[p_j] * x_rank[i, rows, j*P : (j+1)*P] @ B[i, p_j, :n_i]^T
    """
    num_tokens = y.shape[0]
    num_slices, _, _, page_rank = lora_b.shape
    num_segments = seg_pages.shape[0]
    check_page_table(seg_pages, num_segments, "seg_pages")
    assert seg_starts.shape == (num_segments + 1,) and seg_starts.dtype == torch.int32, "seg_starts [G+1]"
    total_rank = seg_pages.shape[1] * page_rank
    _check_expand_args(y, x_rank, lora_b, scales, slice_sizes, total_rank)
    if num_tokens == 0 or num_segments == 0 or num_slices == 0 or max_seg_len == 0:
        return
    offsets, sizes = slice_tensors(tuple(slice_sizes), y.device)
    rank_pad = pow2_at_least(total_rank)
    block_m = 64 if max_seg_len > 32 else pow2_at_least(max_seg_len)
    block_n = 64
    n_blocks = triton.cdiv(max(slice_sizes), block_n)
    grid = (num_segments, triton.cdiv(max_seg_len, block_m), num_slices * n_blocks)
    _sgmv_expand_paged_kernel[grid](
        x_rank, lora_b, y, seg_starts, seg_pages, scales, offsets, sizes, total_rank, n_blocks,
        x_rank.stride(0), x_rank.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), y.stride(0),
        seg_pages.stride(0),
        PAGE_RANK=page_rank, RANK_PAD=rank_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=needs_upcast(y.dtype), PRECISION=dot_precision(y.dtype), num_warps=4,
    )  # fmt: skip
