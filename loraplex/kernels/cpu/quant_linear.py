"""Projections from packed weights (``PackedWeight``) with the C kernel of ``quant_linear.c``.

    y = x @ dequantize(W)^T + b        x float32, W in its block format, fp32 accumulation

Rows of x up to ``direct_max_m()`` decode the weight's blocks in registers as they stream
(a decode step reads the packed bytes once: Q4_1 is 4.5 bits a weight against float32's 32);
more rows decode one panel of weights at a time into a cache-resident float buffer and run
the float panel kernel on it (``linear_panels.c``), each weight decoded once per step.
Formats the library lacks (``c_id`` 0) and other dtypes fall back to the torch reference.

The 16-row interleaved formats (``interleave``; ``quant_x16.c``) take another plan at any
number of rows: each row of x quantized per 32-block to int16 (or int8), integer dot products
against the blocks (AVX-512 VNNI ``vpdpwssd`` / ``vpdpbusd``, 16 weight rows per vector), one
float scale per block ("panels" decodes them to float panels as above, exactly). Without
VNNI, "auto" gives the int16 kernel only up to ``x16_direct_max_m(format)`` rows: past that the
work is compute-bound and one ``vpmaddwd`` + add per 16 multiply-adds is no faster than an FMA
per 8, so the exact panels run; int8 activations (llama.cpp's arithmetic; ``vpmaddubsw``, 32
an instruction, for Q4 blocks) stay integer at every m.

On a CPU with AMX (Intel Xeon since Sapphire Rapids; ``quant_amx.c``), "auto" runs a step of
many rows (``amx_min_m``: 32 for float x, 64 for int8 x) on the tile unit: int8 x as above, in
16 x 16 tiles; float x split into two bf16 halves against the de-quantized weights' two halves
(TDPBF16PS, fp32 sums), which keeps more of x than the int16 blocks. ``LORAPLEX_AMX=0`` turns it off.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from loraplex.kernels.contracts import PackedWeight, WeightFormat
from loraplex.kernels.cpu.build import bind, limit
from loraplex.kernels.formats import FORMATS
from loraplex.kernels.formats.interleaved import GROUP, Interleaved

ARGTYPES = (
    ctypes.c_void_p,  # x
    ctypes.c_int64,  # x row stride (elements)
    ctypes.c_void_p,  # packed weight
    ctypes.c_void_p,  # bias or NULL
    ctypes.c_void_p,  # y
    ctypes.c_int64,  # y row stride
    ctypes.c_int64,  # m
    ctypes.c_int64,  # n
    ctypes.c_int64,  # k
    ctypes.c_int,  # threads
    ctypes.c_int,  # format id
    ctypes.c_int64,  # row bytes
    ctypes.c_int,  # plan: 0 by m, 1 direct, 2 panels, 3 amx
)
PLANS = {"auto": 0, "direct": 1, "panels": 2, "amx": 3}


def c_kernel() -> Any | None:
    """The bound ``loraplex_qlinear_f32``, or None when the library is unavailable."""
    return bind("loraplex_qlinear_f32", ARGTYPES)


def direct_max_m() -> int:
    """Most rows of x the in-register plan takes under "auto" (0 when unavailable)."""
    return limit("loraplex_qlinear_direct_max_m")


def x16_direct_max_m(weight_format: WeightFormat) -> int | None:
    """Most rows of x an interleaved format computes with integer dot products under "auto"
    (None: any number; the rest run the exact float panels)."""
    fn = bind("loraplex_qx16_direct_max_m", (ctypes.c_int,))
    if fn is None or not isinstance(weight_format, Interleaved):
        return None
    limit_m = int(fn(weight_format.c_id))
    return None if limit_m < 0 else limit_m


def has_amx() -> bool:
    """True when the interleaved formats' "auto" plan runs many rows on AMX (``quant_amx.c``:
    a CPU with AMX-INT8, AMX-BF16 and AVX512-BF16, the OS's permission, ``LORAPLEX_AMX`` not 0)."""
    return bool(limit("loraplex_qx16_has_amx"))


def amx_min_m(weight_format: WeightFormat) -> int | None:
    """Fewest rows of x "auto" runs on AMX for an interleaved format where ``has_amx()``
    (None for other formats or without the library)."""
    fn = bind("loraplex_qx16_amx_min_m", (ctypes.c_int,))
    if fn is None or not isinstance(weight_format, Interleaved):
        return None
    return int(fn(weight_format.c_id))


INTERLEAVE_ARGTYPES = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int)


def interleave(weight: PackedWeight, int8_activations: bool = False, in_place: bool = False) -> PackedWeight:
    """``weight`` in its 16-row interleaved format (``formats/interleaved.py``) when it has one
    (Q8_0, Q4_0, Q4_1 with a multiple of 16 rows), else ``weight`` itself. ``in_place``
    rearranges ``weight.data`` itself with the C kernel (the load-time path: no second copy,
    which the engine's heap would keep; ``weight`` must not be used afterwards)."""
    name = f"{weight.format.name}x16{'a8' if int8_activations else ''}"
    fmt = FORMATS.get(name)  # type: ignore[call-overload]
    if not isinstance(fmt, Interleaved) or weight.out_features % GROUP:
        return weight
    fn = bind("loraplex_qx16_interleave", INTERLEAVE_ARGTYPES)
    if not in_place or fn is None or not weight.data.is_contiguous() or weight.data.device.type != "cpu":
        return PackedWeight(fmt, fmt.interleave(weight.data, weight.in_features), weight.in_features)
    if fn(weight.data.data_ptr(), weight.out_features, weight.in_features, fmt.c_id):
        raise RuntimeError(
            f"interleaving {weight.format.name} [{weight.out_features}, {weight.in_features}] failed"
        )
    return PackedWeight(fmt, weight.data, weight.in_features)


ROWS_ARGTYPES = (
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int,
    ctypes.c_void_p,
)


def rows(weight: PackedWeight, index: torch.Tensor) -> torch.Tensor:  # [len(index), in_features] float32
    """``weight.rows(index)`` (an embedding lookup), with the C decoder for the interleaved
    formats: the torch reference's dozen small ops cost a decode step ~0.1 ms."""
    fn = bind("loraplex_qx16_rows", ROWS_ARGTYPES)
    if not isinstance(weight.format, Interleaved) or fn is None or weight.data.device.type != "cpu":
        return weight.rows(index)
    index = index.to(torch.int64).contiguous()
    if index.numel() and not (int(index.min()) >= 0 and int(index.max()) < weight.out_features):
        raise IndexError(f"row index outside [0, {weight.out_features})")
    out = torch.empty(index.numel(), weight.in_features, dtype=torch.float32)
    if fn(
        weight.data.data_ptr(),
        index.data_ptr(),
        index.numel(),
        weight.in_features,
        weight.format.c_id,
        out.data_ptr(),
    ):
        raise RuntimeError(f"row decode failed for {weight.format.name}")
    return out


def supports(weight: PackedWeight, x: torch.Tensor) -> bool:
    """True when the C kernel computes ``x`` by ``weight`` (float32 on the CPU, a C format)."""
    return (
        weight.format.c_id > 0
        and weight.data.device.type == "cpu"
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and c_kernel() is not None
    )


def qlinear(
    x: torch.Tensor,  # [num_tokens, in_features] float32, rows contiguous
    weight: PackedWeight,  # [out_features, row_bytes] uint8
    bias: torch.Tensor | None,  # [out_features] float32
    plan: str = "auto",
) -> torch.Tensor:  # [num_tokens, out_features] float32
    """``x @ dequantize(weight)^T + bias`` with the C kernel."""
    n, k = weight.out_features, weight.in_features
    if not (x.dim() == 2 and x.shape[1] == k):
        raise ValueError(f"x {tuple(x.shape)} vs in_features {k}")
    if not (x.dtype == torch.float32):
        raise ValueError("float32 activations")
    if not weight.data.is_contiguous():
        raise ValueError("packed rows contiguous")
    if bias is not None and not (bias.shape == (n,) and bias.dtype == torch.float32 and bias.is_contiguous()):
        raise ValueError("bias")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    if x.shape[0] == 0:
        return y
    kernel = c_kernel()
    if kernel is None:
        raise RuntimeError("the C kernel library is unavailable")
    rc = kernel(
        x.data_ptr(),
        x.stride(0),
        weight.data.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        y.stride(0),
        x.shape[0],
        n,
        k,
        torch.get_num_threads(),
        weight.format.c_id,
        weight.data.shape[1],
        PLANS[plan],
    )
    if rc != 0:
        raise RuntimeError(f"quantized linear failed ({rc}) for {weight.format.name} [{n}, {k}]")
    return y
