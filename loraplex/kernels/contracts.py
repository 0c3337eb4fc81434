"""Contracts of the engine's compute backends, and the one definition of their names.

Four subsystems have more than one implementation, so each has a contract here
(and one data contract, the weight formats a projection may be stored in):

* ``AttentionBackend``: paged attention over a flat batch, plus the KV cache writes
  and block copies that go with it;
* ``LoRABackend``: batched multi-adapter LoRA (shrink, expand, apply);
* ``LinearBackend``: the base model's dense projections;
* ``PointwiseBackend``: the per-token elementwise ops between them (RMSNorm with the
  residual add, rotary embedding, the gated activation);
* ``WeightFormat`` / ``PackedWeight``: a projection's weight kept in a block format
  (GGUF's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K, F16 / BF16, per-channel int8) and never
  expanded to floats; each format is one module in ``formats/`` with its torch reference.

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
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from loraplex.kernels.lora_layout import LOGICAL_LAYOUT, LoRAWeightLayout
from loraplex.kernels.metadata import AttentionMetadata, LoRAMetadata

AttentionBackendName = Literal["auto", "torch", "triton", "cpu"]
LoRABackendName = Literal["auto", "torch", "triton", "cpu"]
# "triton" computes packed (quantized) weights on CUDA; float weights there take F.linear (cuBLAS).
LinearBackendName = Literal["auto", "torch", "cpu", "triton"]
# Weight formats a projection may be kept in (formats/): block formats from GGUF files,
# float halves, and per-channel int8 made at load time.
WeightFormatName = Literal[
    "f32",
    "f16",
    "bf16",
    "q8_0",
    "q4_0",
    "q4_1",
    "q4_k",
    "q6_k",
    "int8",
    "q8_0x16",
    "q8_0x16a8",
    "q4_0x16",
    "q4_0x16a8",
    "q4_1x16",
    "q4_1x16a8",
]

ATTENTION_BACKEND_NAMES: tuple[AttentionBackendName, ...] = get_args(AttentionBackendName)
LORA_BACKEND_NAMES: tuple[LoRABackendName, ...] = get_args(LoRABackendName)
LINEAR_BACKEND_NAMES: tuple[LinearBackendName, ...] = get_args(LinearBackendName)
WEIGHT_FORMAT_NAMES: tuple[WeightFormatName, ...] = get_args(WeightFormatName)


class AttentionBackend(abc.ABC):
    """Paged attention over a flat batch of decode and prefill/extend tokens.

    Block tables (``AttentionMetadata.block_tables``) are padded with ``PAD_BLOCK_ID``
    past each sequence's last block; an implementation reads only the first
    ``ceil(seq_len / block_size)`` entries of a row and must not read a padded one.

    Per layer, ``forward`` may be given a ``sliding_window`` ``W`` (HF's convention: a
    query at position ``p`` sees keys ``p - W < k <= p``) and a ``logit_softcap`` ``c``
    (Gemma 2: scores become ``c * tanh(scale * q.k / c)`` before the mask and softmax).
    With a window, entries before ``first_visible_block`` (``metadata.py``) of the
    sequence's first new token may be ``PAD_BLOCK_ID`` (blocks the window manager freed):
    an implementation starts reading at that block and never reads the ones before.
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
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Causal attention of each new token over its sequence's paged context.

        The new tokens' K/V must already be in the cache (``write_kv`` first): token
        ``j`` of sequence ``i`` at position ``p = cached_prefix_len + j`` sees context
        positions ``0 .. p``, or ``p - sliding_window + 1 .. p`` with a window (None or 0:
        none). ``logit_softcap`` (None or 0: none) caps the scaled scores with ``tanh``.
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

    def apply_paged(
        self,
        y: torch.Tensor,  # [num_tokens, sum(slice_sizes)]
        x: torch.Tensor,  # [num_tokens, in_features]
        lora_a: torch.Tensor,  # one group's page pool: slots index pages of page_rank rows
        lora_b: torch.Tensor,
        scales: torch.Tensor,  # [num_pages]
        slice_sizes: tuple[int, ...],
        passes: tuple[LoRAMetadata, ...],
    ) -> None:
        """The LoRA delta of adapters stored in pages: ``passes[i]`` maps each token to page
        ``i`` of its adapter (-1: none), so an adapter of rank r is ``ceil(r / page_rank)``
        passes deep and adapters of different ranks share one call with no rank padding.

        LoRA is a sum over rank rows, so the delta is the sum of the passes' deltas. This
        default runs ``apply`` per pass; a backend may fuse the passes (the CPU and Triton ones do).
        """
        for meta in passes:
            self.apply(y, x, lora_a, lora_b, scales, slice_sizes, meta)


class WeightFormat(abc.ABC):
    """How one row of a projection's weight is stored: ``blocks_per_row`` blocks of
    ``block_size`` weights in ``block_bytes`` bytes each (GGUF's layout: a row's blocks are
    contiguous, so rows can be permuted or concatenated as byte rows).

    ``dequantize`` is the portable reference every kernel is tested against; it must give
    the very floats GGUF's own reader (``gguf.quants``) gives, because the fidelity tests
    compare with HF transformers on those floats.
    """

    name: WeightFormatName
    block_size: int  # weights per block
    block_bytes: int  # bytes per block
    c_id: int  # the format's number in the C kernels (quant_linear.c); 0 = none there
    row_extra_bytes: int = 0  # bytes after a row's blocks (per-channel int8: its scale)

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one stored row of ``in_features`` weights."""
        self.check_in_features(in_features)
        return in_features // self.block_size * self.block_bytes + self.row_extra_bytes

    def check_in_features(self, in_features: int) -> None:
        if in_features % self.block_size:
            raise ValueError(
                f"{self.name} stores rows in blocks of {self.block_size} weights; "
                f"{in_features} is not a multiple"
            )

    @abc.abstractmethod
    def dequantize(self, data: torch.Tensor, in_features: int) -> torch.Tensor:  # [rows, in] float32
        """The float32 weights of ``data`` ([rows, row_bytes] uint8)."""

    def rows(self, data: torch.Tensor, index: torch.Tensor, in_features: int) -> torch.Tensor:
        """Weight rows ``index`` of ``data`` as float32 (a layout whose byte rows are not its
        weight rows, such as the interleaved formats, reads through its own order)."""
        return self.dequantize(data[index], in_features)

    def quantize(self, weight: torch.Tensor) -> torch.Tensor:  # [rows, row_bytes] uint8
        """Store ``weight`` ([rows, in_features], float) in this format (tests, load-time int8)."""
        raise NotImplementedError(f"{self.name}: weights are read in this format, not written")


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A projection's weight kept in ``format``: ``data`` is [out_features, row_bytes] uint8."""

    format: WeightFormat
    data: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(
                f"packed data must be [rows, bytes] uint8, got {self.data.dtype} {tuple(self.data.shape)}"
            )
        if self.data.shape[1] != self.format.row_bytes(self.in_features):
            raise ValueError(
                f"{self.format.name} rows of {self.in_features} weights take "
                f"{self.format.row_bytes(self.in_features)} bytes, not {self.data.shape[1]}"
            )

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:  # [out_features, in_features] float32
        """The float32 weight (the portable reference; costs the full float matrix)."""
        return self.format.dequantize(self.data, self.in_features)

    def rows(self, index: torch.Tensor) -> torch.Tensor:  # [len(index), in_features] float32
        """Some rows as floats (an embedding lookup from a packed table)."""
        return self.format.rows(self.data, index, self.in_features)

    def to(self, device: torch.device) -> PackedWeight:
        return PackedWeight(self.format, self.data.to(device), self.in_features)


Weight = torch.Tensor | PackedWeight
"""What a projection computes from: a float matrix (or a backend's layout of one), or packed blocks."""


class LinearBackend(abc.ABC):
    """The base model's dense projections, ``y = x @ W^T + b``.

    A backend may keep weights in its own layout: the model passes each weight through
    ``prepare`` once at load time and hands the result back to ``__call__``. Packed
    weights (``PackedWeight``) go through ``prepare_packed`` instead (the same blocks, maybe
    in another order); every backend computes them (the portable one by dequantizing,
    slowly: the reference).
    """

    name: str

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        """The form of ``weight`` ([out_features, in_features]) that ``__call__`` reads."""
        return weight

    def rows(self, weight: PackedWeight, index: torch.Tensor) -> torch.Tensor:  # [len(index), in] float32
        """Rows ``index`` of a packed weight as floats (an embedding lookup)."""
        return weight.rows(index)

    def prepare_packed(self, weight: PackedWeight, int8_activations: bool = False) -> PackedWeight:
        """The layout of a packed weight that ``__call__`` reads best: the same blocks, the same
        bytes (the CPU backend interleaves Q8_0 / Q4 rows for its integer dot products, in
        place: ``weight`` is not to be used afterwards); ``int8_activations`` asks for
        llama.cpp's int8 activations where a layout has them."""
        return weight

    @abc.abstractmethod
    def __call__(
        self,
        x: torch.Tensor,  # [num_tokens, in_features]
        weight: Weight,  # what prepare returned, or a PackedWeight
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
    def head_rms_norm(
        self,
        x: torch.Tensor,  # [num_tokens, num_heads * head_dim], may be a row-strided view; normed in place
        weight: torch.Tensor,  # [head_dim]
        eps: float,
    ) -> None:
        """RMSNorm of every ``head_dim``-wide head of ``x`` with ``weight``, in place (Qwen3's and
        Gemma 3's q and k norms, before RoPE)."""

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
