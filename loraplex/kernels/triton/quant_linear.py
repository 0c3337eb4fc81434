"""Projections from packed weights on CUDA: a Triton GEMM that decodes the blocks in registers.

    for each (BLOCK_M rows of x, BLOCK_N weight rows) tile (one program):
        acc = 0
        for k0 in 0, 32, ..., K - 32:
            w = decode(W[n, k0 : k0 + 32])          # [BLOCK_N, 32] from the packed bytes
            acc += x[m, k0 : k0 + 32] @ w^T          # tl.dot, fp32 accumulation
        y[m, n] = acc * row_scale[n] + bias[n]

Every format is one branch of ``_decode`` on a constexpr format id (``WeightFormat.c_id``):
each weight finds its block's bytes from its index (the k-quants' sub-block scales too), so
the weights never exist as floats outside registers. K must be a multiple of 32 (GGUF block
formats are; the launcher says so otherwise). The torch reference is
``portable.linear.reference_linear``; interpreter tests compare the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.contracts import LinearBackend, PackedWeight, Weight
from loraplex.kernels.portable.linear import reference_linear
from loraplex.kernels.triton.common import SUPPORTED_DTYPES, dot_precision

BLOCK_K = 32
# format ids (WeightFormat.c_id)
Q8_0, Q4_0, Q4_1, F16, BF16, INT8, F32, Q4_K, Q6_K = 1, 2, 3, 4, 5, 6, 7, 8, 9
_BLOCKS = {Q8_0: (32, 34), Q4_0: (32, 18), Q4_1: (32, 20), F16: (16, 32), BF16: (16, 32)}
_BLOCKS.update({INT8: (16, 16), F32: (16, 64), Q4_K: (256, 144), Q6_K: (256, 210)})


@triton.jit
def _u16(p, mask):
    lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
    return lo | (hi << 8)


@triton.jit
def _f16(p, mask):
    return _u16(p, mask).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u32(p, mask):
    lo = _u16(p, mask).to(tl.uint32)
    hi = _u16(p + 2, mask).to(tl.uint32)
    return lo | (hi << 16)


@triton.jit
def _decode(row_ptr, kk, mask, FMT: tl.constexpr, BS: tl.constexpr, BB: tl.constexpr):
    """Weights ``kk`` ([1, BLOCK_K]) of the rows at ``row_ptr`` ([BLOCK_N, 1]) as float32."""
    block = row_ptr + (kk // BS) * BB
    j = kk % BS
    if FMT == 1:  # Q8_0: d * q
        q = tl.load(block + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = _f16(block, mask) * q
    elif FMT == 2 or FMT == 3:  # Q4_0: d * (q - 8); Q4_1: d * q + m
        head = 2 if FMT == 2 else 4
        byte = tl.load(block + head + (j % 16), mask=mask, other=0)
        q = ((byte >> ((j // 16) * 4).to(tl.uint8)) & 0xF).to(tl.float32)
        w = _f16(block, mask) * (q - 8.0) if FMT == 2 else _f16(block, mask) * q + _f16(block + 2, mask)
    elif FMT == 4:
        w = _f16(block + 2 * j, mask)
    elif FMT == 5:
        w = _u16(block + 2 * j, mask).to(tl.bfloat16, bitcast=True).to(tl.float32)
    elif FMT == 6:  # int8 (the row scale is applied to the output)
        w = tl.load(block + j, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    elif FMT == 7:
        w = _u32(block + 4 * j, mask).to(tl.float32, bitcast=True)
    elif FMT == 8:  # Q4_K: d * sc[s] * q - dmin * m[s], 32-weight sub-blocks s
        s = j // 32
        g = s // 2
        byte = tl.load(block + 16 + 32 * g + (j % 32), mask=mask, other=0)
        q = ((byte >> ((s % 2) * 4).to(tl.uint8)) & 0xF).to(tl.float32)
        # ggml's get_scale_min_k4 over the 12 packed bytes: groups a = [0, 4), b = [4, 8), c = [8, 12)
        a = tl.load(block + 4 + (s % 4), mask=mask, other=0)
        b = tl.load(block + 8 + (s % 4), mask=mask, other=0)
        c = tl.load(block + 12 + (s % 4), mask=mask, other=0)
        first = s < 4
        sc = tl.where(first, a & 63, (c & 0xF) | ((a >> 6) << 4))
        mn = tl.where(first, b & 63, (c >> 4) | ((b >> 6) << 4))
        w = _f16(block, mask) * sc.to(tl.float32) * q - _f16(block + 2, mask) * mn.to(tl.float32)
    else:  # Q6_K: d * sc[j // 16] * (q - 32)
        half = j // 128
        p = j % 128
        quarter = p // 32
        lane = p % 32
        ql = tl.load(block + 64 * half + lane + 32 * (quarter % 2), mask=mask, other=0)
        qh = tl.load(block + 128 + 32 * half + lane, mask=mask, other=0)
        low = (ql >> ((quarter // 2) * 4).to(tl.uint8)) & 0xF
        high = (qh >> (2 * quarter).to(tl.uint8)) & 3
        q = (low | (high << 4)).to(tl.float32) - 32.0
        sc = tl.load(block + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = _f16(block + 208, mask) * sc * q
    return w


@triton.jit
def _qlinear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    row_bytes,
    FMT: tl.constexpr,
    BS: tl.constexpr,
    BB: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK)
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * row_bytes
    n_mask = offs_n[:, None] < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        kk = k0 + offs_k
        x = tl.load(
            x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + kk[None, :],
            mask=(offs_m[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        w = _decode(rows, kk[None, :], n_mask, FMT, BS, BB)  # [BLOCK_N, BLOCK]
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if FMT == 6:  # int8: the float32 scale after each row's K weights
        scale = _u32(w_ptr + offs_n.to(tl.int64) * row_bytes + K, offs_n < N).to(tl.float32, bitcast=True)
        acc = acc * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def supports(weight: PackedWeight, x: torch.Tensor) -> bool:
    """True when the Triton kernel computes ``x`` by ``weight``."""
    return (
        weight.format.c_id in _BLOCKS
        and weight.in_features % BLOCK_K == 0
        and x.dtype in SUPPORTED_DTYPES
        and x.device == weight.data.device
    )


def triton_qlinear(
    x: torch.Tensor,  # [num_tokens, in_features], rows contiguous
    weight: PackedWeight,  # [out_features, row_bytes] uint8, on x's device
    bias: torch.Tensor | None,  # [out_features]
) -> torch.Tensor:  # [num_tokens, out_features] in x's dtype
    """``x @ dequantize(weight)^T + bias`` with the Triton kernel (fp32 accumulation)."""
    n, k = weight.out_features, weight.in_features
    assert supports(weight, x), f"{weight.format.name} [{n}, {k}] with {x.dtype} x on {x.device}"
    assert x.dim() == 2 and x.shape[1] == k, f"x {tuple(x.shape)} vs in_features {k}"
    assert weight.data.is_contiguous(), "packed rows contiguous"
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous(), "bias"
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    bs, bb = _BLOCKS[weight.format.c_id]
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _qlinear_kernel[grid](
        x,
        weight.data,
        bias if bias is not None else x,
        y,
        m,
        n,
        k,
        x.stride(0),
        y.stride(0),
        weight.data.shape[1],
        FMT=weight.format.c_id,
        BS=bs,
        BB=bb,
        HAS_BIAS=bias is not None,
        PRECISION=dot_precision(torch.float32),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK=BLOCK_K,
    )
    return y


class TritonLinearBackend(LinearBackend):
    """Packed weights through the Triton kernel; float weights through ``F.linear`` (cuBLAS)."""

    name = "triton"

    def __call__(
        self,
        x: torch.Tensor,
        weight: Weight,
        bias: torch.Tensor | None,
        out_features: int,
    ) -> torch.Tensor:
        if isinstance(weight, PackedWeight):
            if supports(weight, x):
                return triton_qlinear(x, weight, bias)
            return reference_linear(x, weight, bias)
        return torch.nn.functional.linear(x, weight, bias)
