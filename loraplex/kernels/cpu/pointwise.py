"""The CPU pointwise backend: fused C kernels (``pointwise.c``) for float32, torch for the rest."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from loraplex.kernels.cpu.build import bind
from loraplex.kernels.portable.pointwise import PortablePointwiseBackend

_I64, _F32, _PTR, _INT = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_NORM = ("loraplex_add_rms_norm_f32", (_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _F32, _INT))
_ROPE = ("loraplex_rope_neox_f32", (_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _INT))
_SILU = ("loraplex_silu_mul_f32", (_PTR, _I64, _PTR, _I64, _I64, _I64, _INT))
_HEAD_NORM = ("loraplex_head_rms_norm_f32", (_PTR, _I64, _I64, _I64, _PTR, _I64, _F32, _INT))


def _fn(spec: tuple[str, tuple[Any, ...]]) -> Any | None:
    return bind(spec[0], spec[1])


def c_kernels() -> dict[str, Any] | None:
    """The bound C entry points by name (``add_rms_norm``, ``head_rms_norm``, ``rope_neox``,
    ``silu_mul``), or None."""
    fns = {
        "add_rms_norm": _fn(_NORM),
        "head_rms_norm": _fn(_HEAD_NORM),
        "rope_neox": _fn(_ROPE),
        "silu_mul": _fn(_SILU),
    }
    return None if any(f is None for f in fns.values()) else fns


def available() -> bool:
    """True when the C library (and so these kernels) loaded."""
    return _fn(_NORM) is not None


def _rows_ok(t: torch.Tensor) -> bool:
    """A float32 CPU matrix whose rows are contiguous (any row stride)."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1


class CpuPointwiseBackend(PortablePointwiseBackend):
    """C kernels where the tensors are float32 CPU rows; the portable ops otherwise."""

    name = "cpu"

    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        kernel = _fn(_HEAD_NORM)
        head_dim = weight.shape[0]
        if (
            kernel is None
            or not _rows_ok(x)
            or x.shape[1] % head_dim
            or weight.dtype != torch.float32
            or not weight.is_contiguous()
        ):
            super().head_rms_norm(x, weight, eps)
            return
        heads, threads = x.shape[1] // head_dim, torch.get_num_threads()
        kernel(x.data_ptr(), x.stride(0), heads, head_dim, weight.data_ptr(), x.shape[0], eps, threads)

    def add_rms_norm(
        self, delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kernel = _fn(_NORM)
        if (
            kernel is None
            or not _rows_ok(residual)
            or (delta is not None and (not _rows_ok(delta) or delta.shape != residual.shape))
            or weight.dtype != torch.float32
            or not weight.is_contiguous()
        ):
            return super().add_rms_norm(delta, residual, weight, eps)
        rows, dim = residual.shape
        out = torch.empty(rows, dim, dtype=torch.float32)
        kernel(
            None if delta is None else delta.data_ptr(),
            0 if delta is None else delta.stride(0),
            residual.data_ptr(),
            residual.stride(0),
            weight.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            rows,
            dim,
            eps,
            torch.get_num_threads(),
        )
        return out, residual

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
        kernel = _fn(_ROPE)
        if (
            kernel is None
            or not _rows_ok(qk)
            or not _rows_ok(cos)
            or not _rows_ok(sin)
            or cos.stride(0) != sin.stride(0)
            or qk.shape[1] % head_dim
            or head_dim % 2
        ):
            super().rotary(qk, cos, sin, head_dim)
            return
        kernel(
            qk.data_ptr(),
            qk.stride(0),
            qk.shape[1] // head_dim,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            cos.stride(0),
            qk.shape[0],
            torch.get_num_threads(),
        )

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        kernel = _fn(_SILU)
        if kernel is None or not _rows_ok(gate_up) or gate_up.shape[1] % 2:
            return super().silu_and_mul(gate_up)
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=torch.float32)
        kernel(
            gate_up.data_ptr(),
            gate_up.stride(0),
            out.data_ptr(),
            out.stride(0),
            rows,
            width // 2,
            torch.get_num_threads(),
        )
        return out
