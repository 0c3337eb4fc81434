"""LoRA expand: ``y[:, slice] += scale[slot] * x_rank @ B[slot]^T``, in place.

``lora_b [num_slices, max_loras, max_out, max_rank]`` stacks the output slices of
a fused projection (q/k/v or gate/up); slice ``i`` adds into columns
``offset_i : offset_i + size_i`` of ``y``, where sizes may differ (GQA: q is wider
than k and v) and ``max_out`` is the widest. As for shrink there is a per-token
BGMV kernel for decode and a per-segment SGMV kernel (tensor cores) for prefill.

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
) -> None:
    num_slices, max_loras, max_out, max_rank = lora_b.shape
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
