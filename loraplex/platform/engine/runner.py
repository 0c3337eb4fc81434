"""Builds one step's ``ForwardBatch`` from the scheduler's output and runs the forward.

Everything the forward reads comes from ``SchedulerOutput``: which sequences run,
how many tokens each, and the KV blocks each uses (the runner never asks the block
manager). Only the positions that sample (the last token of a sequence whose known
tokens are now all computed) go through the LM head, so a prefill chunk of 2,000
tokens costs one row of logits, not 2,000.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from loraplex.kernels.contracts import AttentionBackend
from loraplex.kernels.metadata import PAD_BLOCK_ID, AttentionMetadata, LoRAMetadata
from loraplex.platform.engine.scheduler_output import SchedulerOutput
from loraplex.platform.model.forward_batch import ForwardBatch, LoRAApplier, LoRABatch
from loraplex.platform.model.llama import LlamaForCausalLM
from loraplex.storage.kv.kv_cache import KVCache

logger = logging.getLogger(__name__)


class TokenState(Protocol):
    """What a batch row reads of its sequence: its tokens and how many have KV already."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...


class BatchRow(Protocol):
    """One sequence's part of a forward (``ScheduledSeq`` is one; a draft model has its own)."""

    @property
    def seq(self) -> TokenState: ...

    @property
    def num_new_tokens(self) -> int: ...

    @property
    def block_ids(self) -> tuple[int, ...]: ...

    @property
    def num_draft(self) -> int: ...

    @property
    def completes(self) -> bool: ...


class ModelRunner:
    """Owns the model, its KV cache and its attention backend on one device."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        attn: AttentionBackend,
        device: torch.device,
        *,
        enforce_eager: bool = False,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attn = attn
        self.device = device
        self.block_size = kv_cache.block_size
        # The CPU graph: the layers as prebound C calls, unless asked for layer by layer.
        self.graph_off_reason = "enforce_eager" if enforce_eager else model.use_cpu_graph(attn)
        if self.graph_off_reason and device.type == "cpu":
            logger.info("CPU graph off (layer by layer): %s", self.graph_off_reason)

    def build_batch(
        self,
        rows: Sequence[BatchRow],
        lora_slots: list[int] | None = None,
        lora_applier: LoRAApplier | None = None,
    ) -> tuple[ForwardBatch, list[int]]:
        """The step's ``ForwardBatch`` and, per logits row, the index into ``rows``.

        ``lora_slots`` gives each scheduled sequence's adapter slot (-1 = base model);
        without it, or when no token uses an adapter, the batch has no LoRA part.
        """
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sampling_idx: list[int] = []
        token_slots: list[int] = []
        num_decodes = 0
        for i, item in enumerate(rows):
            seq = item.seq
            start, n = seq.num_computed_tokens, item.num_new_tokens
            table = item.block_ids
            ids.extend(seq.token_ids[start : start + n])
            if n == 1:
                # The backends run the first ``num_decodes`` rows with the decode kernel: only a
                # leading run counts (a one-token row after a longer one is run as a chunk).
                num_decodes += num_decodes == i
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                pos = range(start, start + n)
                positions.extend(pos)
                slots.extend(table[p // bs] * bs + p % bs for p in pos)
            starts.append(starts[-1] + n)
            seq_lens.append(start + n)
            if item.num_draft:  # speculative: every position is scored (verification)
                logits_rows.extend(range(starts[-2], starts[-1]))
                sampling_idx.extend([i] * n)
            elif item.completes:
                logits_rows.append(starts[-1] - 1)
                sampling_idx.append(i)
            if lora_slots is not None:
                token_slots.extend([lora_slots[i]] * n)
        width = max((len(item.block_ids) for item in rows), default=0)
        dev = self.device
        # PAD, not 0: block 0 is a real block, and a kernel that read a padded entry
        # would attend over another sequence's KV without any error.
        block_tables = torch.full((len(rows), width), PAD_BLOCK_ID, dtype=torch.int32)
        for r, item in enumerate(rows):
            block_tables[r, : len(item.block_ids)] = torch.tensor(item.block_ids, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            num_decodes=num_decodes,
            max_query_len=max((b - a for a, b in itertools.pairwise(starts)), default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_cpu=tuple(starts),
            seq_lens_cpu=tuple(seq_lens),
        )
        lora: LoRABatch | None = None
        if lora_applier is not None and any(s >= 0 for s in token_slots):
            lora = LoRABatch(LoRAMetadata.from_token_slots(token_slots, dev), lora_applier)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            attn=meta,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            lora=lora,
        )
        return batch, sampling_idx

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        lora_slots: list[int] | None = None,
        lora_applier: LoRAApplier | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Run the step; return logits ``[num_sampling_seqs, vocab]`` and their seq indices."""
        if out.block_copies:
            src = torch.tensor([c.src for c in out.block_copies], dtype=torch.long, device=self.device)
            dst = torch.tensor([c.dst for c in out.block_copies], dtype=torch.long, device=self.device)
            self.attn.copy_blocks(self.kv_cache.all_tensors, src, dst)
        return self.logits_for(out.scheduled, lora_slots, lora_applier)

    @torch.inference_mode()
    def logits_for(
        self,
        rows: Sequence[BatchRow],
        lora_slots: list[int] | None = None,
        lora_applier: LoRAApplier | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Run the forward over ``rows`` (their KV slots already allocated); the logits of the rows
        that sample, and per logits row its index into ``rows``."""
        batch, sampling_idx = self.build_batch(rows, lora_slots, lora_applier)
        hidden = self.model(batch, self.kv_cache, self.attn)
        return self.model.compute_logits(hidden[batch.logits_indices]), sampling_idx
