"""Contracts of the engine's compute backends, and the one definition of their names.

Four subsystems have more than one implementation, so each has a contract here:

* ``AttentionBackend``: paged attention over a flat batch, plus the KV cache writes
  and block copies that go with it;
* ``LoRABackend``: batched multi-adapter LoRA (shrink, expand, apply);
* ``LinearBackend``: the base model's dense projections;
* ``PointwiseBackend``: the per-token elementwise ops between them (RMSNorm with the
  residual add, rotary embedding, the gated activation).

Implementations live in ``portable/`` (pure PyTorch, runs anywhere), ``cpu/`` (C
kernels compiled for the host) and ``triton/`` (CUDA); ``registry.py`` picks one by
name and device. Implementations import this module, never the registry.

The names users choose from (``EngineConfig``, the CLI's flags) are the ``Literal``
types below and the tuples derived from them. "torch" names the portable backend.

KV cache layout (per layer, one tensor each for K and V)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

so one block's tokens are contiguous and one token's heads are contiguous.
"""

from __future__ import annotations

import abc
from typing import Literal, get_args

import torch

from loraplex.kernels.lora_layout import LOGICAL_LAYOUT, LoRAWeightLayout
from loraplex.kernels.metadata import AttentionMetadata, LoRAMetadata

AttentionBackendName = Literal["auto", "torch", "triton", "cpu"]
LoRABackendName = Literal["auto", "torch", "triton", "cpu"]
# No Triton linear backend: on CUDA torch's F.linear already runs cuBLAS.
LinearBackendName = Literal["auto", "torch", "cpu"]

ATTENTION_BACKEND_NAMES: tuple[AttentionBackendName, ...] = get_args(AttentionBackendName)
LORA_BACKEND_NAMES: tuple[LoRABackendName, ...] = get_args(LoRABackendName)
LINEAR_BACKEND_NAMES: tuple[LinearBackendName, ...] = get_args(LinearBackendName)


class AttentionBackend(abc.ABC):
    """Paged attention over a flat batch of decode and prefill/extend tokens.

    Block tables (``AttentionMetadata.block_tables``) are padded with ``PAD_BLOCK_ID``
    past each sequence's last block; an implementation reads only the first
    ``ceil(seq_len / block_size)`` entries of a row and must not read a padded one.
    """

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


class LinearBackend(abc.ABC):
    """The base model's dense projections, ``y = x @ W^T + b``.

    A backend may keep weights in its own layout: the model passes each weight through
    ``prepare`` once at load time and hands the result back to ``__call__``.
    """

    name: str

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        """The form of ``weight`` ([out_features, in_features]) that ``__call__`` reads."""
        return weight

    @abc.abstractmethod
    def __call__(
        self,
        x: torch.Tensor,  # [num_tokens, in_features]
        weight: torch.Tensor,  # what prepare returned
        bias: torch.Tensor | None,  # [out_features]
        out_features: int,
    ) -> torch.Tensor:  # [num_tokens, out_features]
        """``x @ W^T + bias`` from the prepared weight."""


class PointwiseBackend(abc.ABC):
    """Per-token elementwise ops of a decoder layer, each one call (fused where it pays).

    Float32 arithmetic as HF transformers does it (RMSNorm in float32, RoPE as
    ``x * cos + rotate_half(x) * sin``, SiLU as ``x / (1 + exp(-x))``); an
    implementation may sum in another order. Inputs may be row-strided views.
    """

    name: str

    @abc.abstractmethod
    def add_rms_norm(
        self,
        delta: torch.Tensor | None,  # [num_tokens, hidden] added into residual first, or None
        residual: torch.Tensor,  # [num_tokens, hidden], may be updated in place
        weight: torch.Tensor,  # [hidden]
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (normalised, residual + delta)
        """``r = residual + delta``; return ``(weight * r / sqrt(mean(r^2) + eps), r)``."""

    @abc.abstractmethod
    def rotary(
        self,
        qk: torch.Tensor,  # [num_tokens, num_rot_heads * head_dim] (q heads then k heads), rotated in place
        cos: torch.Tensor,  # [num_tokens, head_dim]
        sin: torch.Tensor,  # [num_tokens, head_dim]
        head_dim: int,
    ) -> None:
        """Rotate-half RoPE of every head in ``qk``, in place."""

    @abc.abstractmethod
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * inter] -> [.., inter]
        """``silu(gate) * up`` from a fused gate|up row."""
