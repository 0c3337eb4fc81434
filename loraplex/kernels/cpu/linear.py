"""The CPU linear backend: dense projections from weights packed in column panels.

    y = x @ W^T + b        W packed once at load time as Wp[p, k, c] = W[p * 64 + c, k]

``linear_panels.c`` streams each panel once per 96 rows of x with a register tile of 6
rows and no reductions: 64-column panels with AVX-512, 16-column panels with AVX2 (the
library exports its panel width; ``pack_weight`` follows it). On the 2-core AVX-512
machine it ran SmolLM2's projections at 190-210 GFLOP/s from 64 rows up and at 42 GB/s
of weights for 4 rows, where MKL's ``sgemm`` (through ``F.linear``) reached 93-171
GFLOP/s and 5-18 GB/s: MKL repacks the weight on every call, which for the few rows of
a decode step costs more than the product. On an AVX2-only AMD EPYC (where MKL also
takes a generic path) the AVX2 tile ran 32-row steps ~1.8x and 1-row steps ~2.3x faster
than ``F.linear`` over a model-sized working set, and 1,056-row prefills about as fast.
The packed weight replaces the original (same bytes, padded to whole panels), so the
model holds one copy. float32 only; other dtypes keep ``F.linear``. Packed (quantized)
weights go to ``quant_linear.c`` (other activation dtypes through float32).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F

from loraplex.kernels.contracts import LinearBackend, PackedWeight, Weight
from loraplex.kernels.cpu import quant_linear
from loraplex.kernels.cpu.build import bind, limit
from loraplex.kernels.portable.linear import reference_linear

_ARGTYPES = (
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int,
)


def c_kernel() -> Any | None:
    """The bound C entry point (``loraplex_linear_f32``), or None when the library is unavailable."""
    return bind("loraplex_linear_f32", _ARGTYPES)


def panel_width() -> int:
    """Output columns per packed panel (0 when the C library is unavailable)."""
    return limit("loraplex_linear_panel_width")


def has_register_tile() -> bool:
    """True when the library was built with a tile that fits the CPU's vector registers
    (AVX-512, or AVX2 + FMA); elsewhere the compiler splits its vectors and it spills."""
    return limit("loraplex_linear_register_tile") == 1


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` -> ``[ceil(out / P), in, P]`` panels (rows past ``out`` are zero)."""
    width = panel_width()
    if width <= 0:
        raise RuntimeError("C linear kernel unavailable")
    out_features, in_features = weight.shape
    num_panels = -(-out_features // width)
    padded = torch.zeros(num_panels * width, in_features, dtype=weight.dtype, device=weight.device)
    padded[:out_features] = weight
    return padded.view(num_panels, width, in_features).transpose(1, 2).contiguous()


def linear_packed(
    x: torch.Tensor,  # [num_tokens, in_features] float32, rows contiguous
    packed: torch.Tensor,  # [num_panels, in_features, P] from pack_weight
    bias: torch.Tensor | None,  # [out_features] float32
    out_features: int,
) -> torch.Tensor:  # [num_tokens, out_features]
    """``x @ W^T + bias`` with the C panel kernel."""
    num_panels, in_features, width = packed.shape
    if not (packed.is_contiguous() and width == panel_width()):
        raise ValueError("packed weight layout")
    if not (x.dim() == 2 and x.shape[1] == in_features):
        raise ValueError(f"x {tuple(x.shape)} vs in_features {in_features}")
    if not (x.dtype == torch.float32 and packed.dtype == torch.float32):
        raise ValueError("float32 only")
    if not ((num_panels - 1) * width < out_features <= num_panels * width):
        raise ValueError("out_features vs panels")
    if bias is not None and not (bias.shape == (out_features,) and bias.is_contiguous()):
        raise ValueError("bias")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if x.shape[0] == 0:
        return y
    kernel = c_kernel()
    if kernel is None:
        raise RuntimeError("the C kernel is not built")
    kernel(
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        y.stride(0),
        x.shape[0],
        out_features,
        in_features,
        torch.get_num_threads(),
    )
    return y


class CpuLinearBackend(LinearBackend):
    """Packed-panel C kernel for float32 CPU weights; ``F.linear`` for the rest."""

    name = "cpu"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or c_kernel() is None:
            return weight
        return pack_weight(weight)

    def rows(self, weight: PackedWeight, index: torch.Tensor) -> torch.Tensor:
        return quant_linear.rows(weight, index)

    def prepare_packed(self, weight: PackedWeight, int8_activations: bool = False) -> PackedWeight:
        """Q8_0 / Q4_0 / Q4_1 rows interleaved 16 at a time (``formats/interleaved.py``), which
        the C kernel computes with integer dot products at decode steps (int16 activations, or
        llama.cpp's int8 ones with ``int8_activations``); other formats as they are."""
        if weight.data.device.type != "cpu" or quant_linear.c_kernel() is None:
            return weight
        return quant_linear.interleave(weight, int8_activations, in_place=True)

    def __call__(
        self,
        x: torch.Tensor,
        weight: Weight,
        bias: torch.Tensor | None,
        out_features: int,
    ) -> torch.Tensor:
        if isinstance(weight, PackedWeight):
            if quant_linear.supports(weight, x.float()):
                y = quant_linear.qlinear(x.float(), weight, None if bias is None else bias.float())
                return y.to(x.dtype)
            return reference_linear(x, weight, bias)
        if weight.dim() == 3:  # packed by prepare
            return linear_packed(x, weight, bias, out_features)
        return F.linear(x, weight, bias)
