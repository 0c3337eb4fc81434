"""Run this directory's Triton kernels through the interpreter when there is no GPU.

``@triton.jit`` decides between a compiled kernel and an interpreted one when the
decorated module is imported, from ``TRITON_INTERPRET``; so the variable is set
here, before any test module imports a kernel. It is set only on machines without
CUDA (a GPU machine runs the kernels compiled) and only if the caller has not set
it. Other test directories are unaffected in practice: on a CPU-only machine a
Triton kernel can only ever run interpreted, and nothing else reads the variable.

If another directory's tests imported the kernel modules first (collection order),
those modules hold compiled-mode kernels; they are reloaded here so the tests
below get interpreted ones.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Reload order: helpers first, then kernels, then the backends that import them.
_KERNEL_MODULES = (
    "common",
    "paged_decode",
    "extend_attention",
    "cache_ops",
    "lora_shrink",
    "lora_expand",
    "attention_backend",
    "lora_backend",
    "quant_linear",
)


def _reload_compiled_kernels() -> None:
    common = sys.modules.get("loraplex.kernels.triton.common")
    if common is None or os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(common.dot_f32, InterpretedFunction):
        return
    for name in _KERNEL_MODULES:
        module = sys.modules.get(f"loraplex.kernels.triton.{name}")
        if module is not None:
            importlib.reload(module)


_reload_compiled_kernels()
