"""Pick a backend implementation by name and device.

``select_*_backend("auto", device)`` picks::

    device   attention / LoRA                           linear
    cuda     triton                                     triton (packed weights; F.linear for floats)
    cpu      cpu when its C kernels build, else torch   cpu when its C kernels build, else torch
    other    torch                                      torch

and ``select_pointwise_backend(device)`` the fused C elementwise kernels on the CPU
(torch elsewhere: on CUDA those ops are a small share of a step).

A name other than "auto" forces that backend ("torch" is the portable one; Triton
runs on the CPU under ``TRITON_INTERPRET=1``, slowly, for tests). Implementations
are imported here, lazily, so that choosing one never imports Triton or builds C
kernels it does not need; no implementation imports this module.
"""

from __future__ import annotations

import torch

from loraplex.kernels.contracts import (
    ATTENTION_BACKEND_NAMES,
    LINEAR_BACKEND_NAMES,
    LORA_BACKEND_NAMES,
    WEIGHT_FORMAT_NAMES,
    AttentionBackend,
    AttentionBackendName,
    LinearBackend,
    LinearBackendName,
    LoRABackend,
    LoRABackendName,
    PointwiseBackend,
    WeightFormat,
)


def _check_name(kind: str, name: str, allowed: tuple[str, ...]) -> None:
    if name not in allowed:
        choices = ", ".join(repr(n) for n in allowed)
        raise ValueError(f"unknown {kind} backend {name!r}; choose one of {choices}")


def _cpu_kernels_available(device: torch.device) -> bool:
    from loraplex.kernels.cpu.build import load_library

    return device.type == "cpu" and load_library() is not None


def _resolve_auto(device: torch.device) -> str:
    """What "auto" means for attention and LoRA on ``device``."""
    if device.type == "cuda":
        return "triton"
    return "cpu" if _cpu_kernels_available(device) else "torch"


def _require_cpu_kernels(kind: str, device: torch.device) -> None:
    if not _cpu_kernels_available(device):
        raise ValueError(
            f"the 'cpu' {kind} backend needs a CPU device and a C compiler "
            "(and LORAPLEX_CPU_KERNELS not set to 0); use 'torch' instead"
        )


def select_attention_backend(name: AttentionBackendName, device: torch.device) -> AttentionBackend:
    """Return the attention backend for ``name`` on ``device`` (Triton on CUDA, C on CPU by default)."""
    _check_name("attention", name, ATTENTION_BACKEND_NAMES)
    chosen = _resolve_auto(device) if name == "auto" else name
    if chosen == "triton":
        from loraplex.kernels.triton.attention_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if chosen == "cpu":
        _require_cpu_kernels("attention", device)
        from loraplex.kernels.cpu.attention import CpuAttentionBackend

        return CpuAttentionBackend()
    from loraplex.kernels.portable.attention import PortableAttentionBackend

    return PortableAttentionBackend()


def select_lora_backend(name: LoRABackendName, device: torch.device) -> LoRABackend:
    """Return the LoRA backend for ``name`` on ``device`` (Triton on CUDA, C on CPU by default)."""
    _check_name("LoRA", name, LORA_BACKEND_NAMES)
    chosen = _resolve_auto(device) if name == "auto" else name
    if chosen == "triton":
        from loraplex.kernels.triton.lora_backend import TritonLoRABackend

        return TritonLoRABackend()
    if chosen == "cpu":
        _require_cpu_kernels("LoRA", device)
        from loraplex.kernels.cpu.lora import CpuLoRABackend

        return CpuLoRABackend()
    from loraplex.kernels.portable.lora import PortableLoRABackend

    return PortableLoRABackend()


def _linear_register_tile() -> bool:
    from loraplex.kernels.cpu.linear import has_register_tile

    return has_register_tile()


def select_linear_backend(name: LinearBackendName, device: torch.device) -> LinearBackend:
    """Return the linear backend for ``name`` on ``device`` (C panels on CPU, Triton for packed
    weights on CUDA, by default)."""
    _check_name("linear", name, LINEAR_BACKEND_NAMES)
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from loraplex.kernels.triton.quant_linear import TritonLinearBackend

        return TritonLinearBackend()
    # "auto" takes the panel kernel where the library has a register tile for this CPU
    # (AVX-512: 6 x 64, AVX2 + FMA: 6 x 16); built for other vector units its tile spills
    # and F.linear is faster ("cpu" forces it anywhere it builds).
    use_cpu = name == "cpu" or (name == "auto" and _cpu_kernels_available(device) and _linear_register_tile())
    if use_cpu:
        _require_cpu_kernels("linear", device)
        from loraplex.kernels.cpu.linear import CpuLinearBackend

        return CpuLinearBackend()
    from loraplex.kernels.portable.linear import PortableLinearBackend

    return PortableLinearBackend()  # torch, and 'auto' on other devices


def select_pointwise_backend(device: torch.device, *, portable: bool = False) -> PointwiseBackend:
    """The elementwise ops (norms, rotary, activation): fused C kernels on the CPU when they
    build, torch elsewhere (and with ``portable``, or ``LORAPLEX_CPU_KERNELS=0``)."""
    if not portable and _cpu_kernels_available(device):
        from loraplex.kernels.cpu.pointwise import CpuPointwiseBackend

        return CpuPointwiseBackend()
    from loraplex.kernels.portable.pointwise import PortablePointwiseBackend

    return PortablePointwiseBackend()


def weight_format(name: str) -> WeightFormat:
    """The ``WeightFormat`` called ``name`` (``formats/``): q8_0, q4_0, q4_1, q4_k, q6_k, f16, bf16,
    f32 or int8."""
    if name not in WEIGHT_FORMAT_NAMES:
        raise ValueError(f"unknown weight format {name!r}; choose one of {', '.join(WEIGHT_FORMAT_NAMES)}")
    from loraplex.kernels.formats import FORMATS

    return FORMATS[name]
