"""``ForwardBatch``: everything one forward pass reads, passed down as one value.

The engine builds one per step from the scheduler's output (``engine/runner.py``) and
hands it to the model; nothing reaches the model through attributes set on the side.
The model layer defines it because the model is what consumes it: the engine imports
the model, never the reverse.

Flat layout (see ``kernels/metadata.py`` for the index arithmetic)::

    input_ids, positions          [num_tokens]      decodes first, then prefill chunks
    attn.slot_mapping             [num_tokens]      where each token's K/V is written
    attn.block_tables             [num_seqs, W]     PAD_BLOCK_ID past each sequence's blocks
    lora.token_slots              [num_tokens]      adapter slot per token, -1 = base model
    logits_indices                [num_sampling]    rows whose hidden state reaches the LM head
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from loraplex.kernels.cpu.lora import BoundSite
from loraplex.kernels.metadata import AttentionMetadata, LoRAMetadata

LoRASites = Sequence[tuple[BoundSite | None, ...]]
"""Per layer, per projection group (``qkv, o, gate_up, down``): the C kernel's call for the
step at that site, None where no token has pages there."""


class LoRAApplier(Protocol):
    """Adds a batch's LoRA deltas to one fused projection's output, in place.

    ``meta`` says which adapter slot each token uses; the applier owns the stacked
    adapter weights and the LoRA kernels.
    """

    def apply(
        self,
        layer_idx: int,
        group: str,
        x: torch.Tensor,  # [num_tokens, in_features]
        y: torch.Tensor,  # [num_tokens, out_features], updated in place
        meta: LoRAMetadata,
    ) -> None: ...


@dataclass(frozen=True)
class LoRABatch:
    """The LoRA part of a forward batch: per-token slots and who applies them."""

    meta: LoRAMetadata
    applier: LoRAApplier

    def __call__(self, layer_idx: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        self.applier.apply(layer_idx, group, x, y, self.meta)

    def c_sites(self, num_layers: int) -> LoRASites | None:
        """Every site's C kernel call for this step, planned once (``CpuGraph`` makes them
        without a Python round trip); None when the applier cannot plan them (the hook serves)."""
        plan = getattr(self.applier, "c_sites", None)
        return None if plan is None else plan(self.meta, num_layers)


@dataclass(frozen=True)
class ForwardBatch:
    """One step's flat batch on the model's device."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling_seqs] int64, rows of the hidden states
    lora: LoRABatch | None = None  # None: no token of this batch uses an adapter

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
