"""Helpers shared by the Triton kernels: interpreter detection, dot precision, sizes.

Two quirks of Triton shape every kernel here:

* ``tl.dot`` needs every dimension >= 16, so small dimensions (a GQA group of 3,
  a LoRA rank of 8, a page of 8 tokens) are padded up and masked.
* Under ``TRITON_INTERPRET=1`` (triton 3.9) ``tl.dot`` on two bfloat16 operands
  returns garbage (numpy has no bfloat16; the interpreter multiplies the raw bit
  patterns). Kernels therefore take an ``UPCAST`` constexpr that converts dot
  operands to float32 first; launchers set it only when interpreting bfloat16, so
  compiled GPU code keeps its native bf16 tensor-core path.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Dtypes the engine runs in; every kernel accumulates in float32.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_interpreting() -> bool:
    """True when Triton kernels run on the CPU through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def needs_upcast(dtype: torch.dtype) -> bool:
    """Whether dot operands of ``dtype`` must be upcast to fp32 (interpreter bf16 bug)."""
    return is_interpreting() and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` for ``tl.dot``: exact fp32 ("ieee") instead of TF32 for fp32 inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def pow2_at_least(value: int, minimum: int = 16) -> int:
    """Smallest power of two >= ``value`` and >= ``minimum`` (tl.dot and tl.arange need it)."""
    return max(minimum, triton.next_power_of_2(max(1, value)))


def check_page_table(pages: torch.Tensor, rows: int, what: str) -> None:
    """Assert a paged LoRA kernel's page table: ``[rows, max_pages]`` int32, rows contiguous."""
    assert pages.dim() == 2 and pages.shape[0] == rows, f"{what} {tuple(pages.shape)} is not [{rows}, P]"
    assert pages.dtype == torch.int32 and pages.shape[1] >= 1, f"{what} must be int32 with >= 1 column"
    assert pages.stride(1) == 1, f"{what} rows must be contiguous"


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (1 when interpreting on the CPU)."""
    if is_interpreting() or not torch.cuda.is_available():
        return 1
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def device_sms(device: torch.device) -> int:
    """``num_sms`` for a tensor's device (1 on the CPU)."""
    if device.type != "cuda":
        return 1
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def dot_f32(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` accumulated in float32 (operands upcast first when ``UPCAST``)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


LOG2E_ = 1.4426950408889634


@triton.jit
def soft_cap_log2(s, softcap):
    """Soft-capping of log2-domain scores ``s = x * log2(e)``: ``c * tanh(x / c) * log2(e)``
    (Gemma 2), with ``tanh(y) = 2 * sigmoid(2y) - 1`` (no tanh in core ``tl``)."""
    x = s / (LOG2E_ * softcap)
    return (2.0 * tl.sigmoid(2.0 * x) - 1.0) * (softcap * LOG2E_)
