"""Flat-batch metadata shared by every attention and LoRA backend.

One engine step runs a *flat* batch: the new tokens of every scheduled sequence are
concatenated into one ``[num_tokens, ...]`` tensor. Decode sequences (one new token)
come first, then prefill chunks (one or more new tokens each), so backends can treat
the first ``num_decodes`` sequences with a decode kernel and the rest with an
extend kernel.

Index arithmetic, for sequence ``i``::

    tokens of i          = query_start_loc[i] : query_start_loc[i + 1]
    query_len(i)         = query_start_loc[i + 1] - query_start_loc[i]
    context_len(i)       = seq_lens[i]            (cached prefix + the new tokens)
    cached_prefix_len(i) = seq_lens[i] - query_len(i)
    KV slot of token t   = slot_mapping[t] = block_id * block_size + offset
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token of a flat batch reads and writes its KV.

    Tensors live on the model's device. ``block_tables`` rows are padded with 0 past
    a sequence's last block; kernels never read past ``ceil(seq_lens[i] / block_size)``.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not write
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    num_decodes: int  # the first num_decodes sequences have query_len == 1
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU-side loops never synchronise with the device.
    query_start_loc_cpu: tuple[int, ...] = ()
    seq_lens_cpu: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes


@dataclass(frozen=True)
class LoRAMetadata:
    """Which adapter slot each token of a flat batch uses.

    ``token_slots[t] == -1`` means token ``t`` runs on the base model only. The
    segment view groups consecutive tokens with the same slot (SGMV); decode tokens
    are usually served token by token (BGMV) from ``token_slots`` directly.
    """

    token_slots: torch.Tensor  # [num_tokens] int32, adapter slot per token, -1 = none
    seg_starts: torch.Tensor  # [num_segments + 1] int32, token offsets of runs
    seg_slots: torch.Tensor  # [num_segments] int32, slot of each run (-1 = none)
    num_active_slots: int  # distinct slots >= 0 used in this batch
    # Host copies of the segment view, for CPU-side loops without device syncs.
    seg_starts_cpu: tuple[int, ...] = ()
    seg_slots_cpu: tuple[int, ...] = ()

    @staticmethod
    def from_token_slots(token_slots: list[int], device: torch.device) -> LoRAMetadata:
        """Build the per-token and per-segment views from a host list of slots."""
        starts: list[int] = [0]
        slots: list[int] = []
        for i, slot in enumerate(token_slots):
            if i == 0 or slot != token_slots[i - 1]:
                if i > 0:
                    starts.append(i)
                slots.append(slot)
        starts.append(len(token_slots))
        if not token_slots:
            starts = [0]
        return LoRAMetadata(
            token_slots=torch.tensor(token_slots, dtype=torch.int32, device=device),
            seg_starts=torch.tensor(starts, dtype=torch.int32, device=device),
            seg_slots=torch.tensor(slots, dtype=torch.int32, device=device),
            num_active_slots=len({s for s in token_slots if s >= 0}),
            seg_starts_cpu=tuple(starts),
            seg_slots_cpu=tuple(slots),
        )
