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
    used blocks of i     = block_tables[i, :ceil(seq_lens[i] / block_size)]
    padding of row i     = block_tables[i, ceil(seq_lens[i] / block_size):] == PAD_BLOCK_ID

Sliding-window layers (HF's convention, window ``W``): a query at position ``p`` sees keys
``k`` with ``p - W < k <= p``. Blocks wholly before the first key any of a sequence's new
tokens sees (``first_visible_block``) may have been returned to the pool and hold
``PAD_BLOCK_ID`` too; kernels given the window never read them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PAD_BLOCK_ID = -1
"""Fills a block-table row past its sequence's last block; no kernel may read it.

Not a valid block id (0 is one), so a kernel that reads past a sequence's blocks
fails or is caught by ``check_block_tables`` instead of reading another sequence's KV.
"""


def window_start(position: int, sliding_window: int | None) -> int:
    """The first key position a query at ``position`` sees (0 without a window)."""
    if not sliding_window:
        return 0
    return max(0, position - sliding_window + 1)


def first_visible_block(first_query_position: int, sliding_window: int | None, block_size: int) -> int:
    """The first block-table entry a sequence whose first new token sits at
    ``first_query_position`` reads (entries before it may be ``PAD_BLOCK_ID``)."""
    return window_start(first_query_position, sliding_window) // block_size


def check_block_tables(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: Sequence[int],  # [num_seqs], host ints
    block_size: int,
    first_blocks: Sequence[int] | None = None,  # [num_seqs]: entries before these are not read
) -> None:
    """Raise ``ValueError`` if a block a sequence uses is ``PAD_BLOCK_ID`` (or any negative id).

    With ``first_blocks`` (sliding windows) the used range of row ``i`` starts at
    ``first_blocks[i]``: a window manager may have freed the blocks before it.

    Reads ``block_tables``: a device sync when it lives on an accelerator, so kernels
    call this only where the table is on the host (or the backend is not a GPU path).
    """
    num_seqs = len(seq_lens)
    if num_seqs == 0:
        return
    table = block_tables[:num_seqs]
    num_used = torch.tensor([-(-n // block_size) for n in seq_lens], device=table.device)
    cols = torch.arange(table.shape[1], device=table.device)[None, :]
    used = cols < num_used[:, None]
    if first_blocks is not None:
        used = used & (cols >= torch.tensor(list(first_blocks), device=table.device)[:, None])
    bad = (table < 0) & used
    if bool(bad.any()):
        seq, idx = (int(i) for i in bad.nonzero()[0].tolist())
        raise ValueError(
            f"block_tables[{seq}, {idx}] is {int(table[seq, idx])} (PAD_BLOCK_ID is {PAD_BLOCK_ID}) but "
            f"sequence {seq} has seq_len {seq_lens[seq]}, so it uses {int(num_used[seq])} blocks of "
            f"{block_size}: the table is padded inside the used range"
        )


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token of a flat batch reads and writes its KV.

    Tensors live on the model's device. ``block_tables`` rows are padded with
    ``PAD_BLOCK_ID`` past a sequence's last block; kernels never read past
    ``ceil(seq_lens[i] / block_size)``.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not write
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, PAD_BLOCK_ID-padded
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

    @staticmethod
    def from_segments(starts: Sequence[int], slots: Sequence[int], device: torch.device) -> LoRAMetadata:
        """Build both views from runs: tokens ``starts[i]:starts[i + 1]`` use ``slots[i]``.

        Adjacent runs of the same slot are merged; costs O(runs) in Python, not O(tokens).
        """
        merged_starts: list[int] = [0]
        merged_slots: list[int] = []
        for i, slot in enumerate(slots):
            if starts[i + 1] == starts[i]:
                continue
            if merged_slots and merged_slots[-1] == slot:
                merged_starts[-1] = starts[i + 1]
            else:
                merged_slots.append(slot)
                merged_starts.append(starts[i + 1])
        if not merged_slots:
            merged_starts = [0]
        lengths = torch.tensor([b - a for a, b in itertools.pairwise(merged_starts)], dtype=torch.int64)
        token_slots = torch.repeat_interleave(torch.tensor(merged_slots, dtype=torch.int32), lengths)
        return LoRAMetadata(
            token_slots=token_slots.to(device),
            seg_starts=torch.tensor(merged_starts, dtype=torch.int32, device=device),
            seg_slots=torch.tensor(merged_slots, dtype=torch.int32, device=device),
            num_active_slots=len({s for s in merged_slots if s >= 0}),
            seg_starts_cpu=tuple(merged_starts),
            seg_slots_cpu=tuple(merged_slots),
        )
