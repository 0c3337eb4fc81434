"""Contracts for the attention, LoRA and linear backends, and the registry that picks one.

Each contract has a PyTorch implementation (``torch_ref``), which runs anywhere and
is the reference the tests compare against, a Triton one (``triton``), used on CUDA,
and ``cpu``: the torch backend with its hot part (decode attention; LoRA; the dense
projections) served by C kernels compiled for the host on first use (``kernels/cpu``).
The linear backend has no Triton version: on CUDA ``auto`` keeps torch's cuBLAS.
``select_*_backend("auto", device)`` picks Triton on CUDA and ``cpu`` on the CPU when
its kernels build, else torch; a name forces one (Triton runs on the CPU under
``TRITON_INTERPRET=1``, slowly, for tests).

KV cache layout (per layer, one tensor each for K and V)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

so one block's tokens are contiguous and one token's heads are contiguous.
"""

from __future__ import annotations

import abc
from typing import Literal

import torch

from loraplex.kernels.lora_layout import LOGICAL_LAYOUT, LoRAWeightLayout
from loraplex.kernels.metadata import AttentionMetadata, LoRAMetadata

BackendName = Literal["auto", "torch", "triton", "cpu"]
LinearBackendName = Literal["auto", "torch", "cpu"]


class LinearBackend:
    """The base model's dense projections, ``y = x @ W^T + b``: torch's ``F.linear``.

    A backend may keep weights in its own layout: the model passes each weight through
    ``prepare`` once at load time and hands the result back to ``__call__``.
    """

    name = "torch"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        """The form of ``weight`` ([out_features, in_features]) that ``__call__`` reads."""
        return weight

    def __call__(
        self,
        x: torch.Tensor,  # [num_tokens, in_features]
        weight: torch.Tensor,  # what prepare returned
        bias: torch.Tensor | None,  # [out_features]
        out_features: int,
    ) -> torch.Tensor:  # [num_tokens, out_features]
        return torch.nn.functional.linear(x, weight, bias)


class AttentionBackend(abc.ABC):
    """Paged attention over a flat batch of decode and prefill/extend tokens."""

    name: str

    @abc.abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    ) -> None:
        """Store each token's K/V at its slot (``block_id * block_size + offset``)."""

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Causal attention of each new token over its sequence's paged context.

        The new tokens' K/V must already be in the cache (``write_kv`` first): token
        ``j`` of sequence ``i`` sees context positions ``0 .. cached_prefix_len + j``.
        """

    @abc.abstractmethod
    def copy_blocks(
        self,
        caches: list[torch.Tensor],  # each [num_blocks, block_size, num_kv_heads, head_dim]
        src: torch.Tensor,  # [num_pairs] int64
        dst: torch.Tensor,  # [num_pairs] int64
    ) -> None:
        """Copy whole blocks ``src[i] -> dst[i]`` in every cache (copy-on-write)."""


class LoRABackend(abc.ABC):
    """Batched multi-adapter LoRA: ``y[t] += scale[s] * (x[t] @ A[s]^T) @ B[s]^T``.

    ``s = token_slots[t]``; tokens with ``s == -1`` are left untouched. The stacked
    weights hold every resident adapter, rank-padded to ``max_rank`` with zeros, and
    one projection may stack several output slices (q/k/v, gate/up) so a single
    call serves a fused projection.
    """

    name: str

    def weight_layout(self, dtype: torch.dtype, device: torch.device) -> LoRAWeightLayout:
        """How the slot buffers should store adapters for this backend (``kernels/lora_layout.py``).

        ``apply`` reads weights in this layout; ``shrink`` / ``expand`` and the other
        backends read the logical one, which every layout can give back.
        """
        return LOGICAL_LAYOUT

    @abc.abstractmethod
    def shrink(
        self,
        x: torch.Tensor,  # [num_tokens, in_features]
        lora_a: torch.Tensor,  # [num_slices, max_loras, max_rank, in_features]
        meta: LoRAMetadata,
    ) -> torch.Tensor:  # [num_slices, num_tokens, max_rank]
        """Project into rank space per slice; rows of tokens without adapter are 0."""

    @abc.abstractmethod
    def expand(
        self,
        y: torch.Tensor,  # [num_tokens, sum(slice_sizes)], updated in place
        x_rank: torch.Tensor,  # [num_slices, num_tokens, max_rank]
        lora_b: torch.Tensor,  # [num_slices, max_loras, max_out, max_rank]
        scales: torch.Tensor,  # [max_loras] float32
        slice_sizes: tuple[int, ...],  # output width of each slice, in order
        meta: LoRAMetadata,
    ) -> None:
        """Add ``scale * x_rank @ B^T`` into each slice's columns of ``y``."""

    def apply(
        self,
        y: torch.Tensor,  # [num_tokens, sum(slice_sizes)]
        x: torch.Tensor,  # [num_tokens, in_features]
        lora_a: torch.Tensor,  # [num_slices, max_loras, max_rank, in_features]
        lora_b: torch.Tensor,  # [num_slices, max_loras, max_out, max_rank]
        scales: torch.Tensor,  # [max_loras]
        slice_sizes: tuple[int, ...],
        meta: LoRAMetadata,
    ) -> None:
        """Shrink then expand: the whole LoRA delta of one (fused) projection.

        ``lora_a`` / ``lora_b`` are in this backend's ``weight_layout`` (the shapes above
        are the logical layout's).
        """
        if meta.num_active_slots == 0:
            return
        x_rank = self.shrink(x, lora_a, meta)
        self.expand(y, x_rank, lora_b, scales, slice_sizes, meta)


def _resolve(name: str, device: torch.device) -> str:
    if name not in ("auto", "torch", "triton", "cpu"):
        raise ValueError(f"unknown kernel backend {name!r}; choose 'auto', 'torch', 'triton' or 'cpu'")
    if name != "auto":
        return name
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        from loraplex.kernels.cpu.build import load_library

        return "cpu" if load_library() is not None else "torch"
    return "torch"


def select_attention_backend(name: BackendName, device: torch.device) -> AttentionBackend:
    """Return the attention backend for ``name`` on ``device`` (Triton on CUDA, C on CPU by default)."""
    chosen = _resolve(name, device)
    if chosen == "triton":
        from loraplex.kernels.triton.attention_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if chosen == "cpu":
        _require_cpu_kernels("attention", device)
        from loraplex.kernels.cpu.attention import CpuAttentionBackend

        return CpuAttentionBackend()
    from loraplex.kernels.torch_ref.attention import TorchAttentionBackend

    return TorchAttentionBackend()


def _require_cpu_kernels(what: str, device: torch.device) -> None:
    from loraplex.kernels.cpu.build import load_library

    if device.type != "cpu" or load_library() is None:
        raise ValueError(
            f"the 'cpu' {what} backend needs a CPU device and a C compiler "
            "(and LORAPLEX_CPU_KERNELS not set to 0); use 'torch' instead"
        )


def select_lora_backend(name: BackendName, device: torch.device) -> LoRABackend:
    """Return the LoRA backend for ``name`` on ``device`` (Triton on CUDA, C on CPU by default)."""
    chosen = _resolve(name, device)
    if chosen == "triton":
        from loraplex.kernels.triton.lora_backend import TritonLoRABackend

        return TritonLoRABackend()
    if chosen == "cpu":
        _require_cpu_kernels("LoRA", device)
        from loraplex.kernels.cpu.lora import CpuLoRABackend

        return CpuLoRABackend()
    from loraplex.kernels.torch_ref.lora import TorchLoRABackend

    return TorchLoRABackend()


def select_linear_backend(name: LinearBackendName, device: torch.device) -> LinearBackend:
    """Return the linear backend for ``name`` on ``device`` (C panels on CPU by default)."""
    if name not in ("auto", "torch", "cpu"):
        raise ValueError(f"unknown linear backend {name!r}; choose 'auto', 'torch' or 'cpu'")
    chosen = _resolve(name, device)
    if chosen == "cpu":
        _require_cpu_kernels("linear", device)
        from loraplex.kernels.cpu.linear import CpuLinearBackend

        return CpuLinearBackend()
    return LinearBackend()  # torch, and 'auto' on CUDA (cuBLAS)
