"""Builds one step's flat batch from the scheduler's output and runs the forward.

Only the positions that sample (the last token of a sequence whose known tokens
are now all computed) go through the LM head, so a prefill chunk of 2,000 tokens
costs one row of logits, not 2,000.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from loraplex.kernels.backend import AttentionBackend
from loraplex.kernels.metadata import AttentionMetadata, LoRAMetadata
from loraplex.platform.model.llama import LlamaForCausalLM, LoRAHook
from loraplex.platform.scheduler import SchedulerOutput
from loraplex.storage.kv.block_manager import KVBlockManager
from loraplex.storage.kv.kv_cache import KVCache


@dataclass(frozen=True)
class StepBatch:
    """Host-side description of a flat batch, kept for the LoRA hook and tests."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling_seqs] int64, rows of the hidden states
    sampling_seq_idx: list[int]  # index into scheduled of each logits row
    token_counts: list[int]  # num_new_tokens of each scheduled sequence


class ModelRunner:
    """Owns the model, its KV cache and its attention backend on one device."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        attn: AttentionBackend,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attn = attn
        self.device = device
        self.block_size = kv_cache.block_size

    def build_batch(self, out: SchedulerOutput, kv: KVBlockManager) -> StepBatch:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        sampling_idx: list[int] = []
        num_decodes = 0
        for i, item in enumerate(out.scheduled):
            seq = item.seq
            start, n = seq.num_computed_tokens, item.num_new_tokens
            table = kv.block_table(seq.seq_id)
            ids.extend(seq.token_ids[start : start + n])
            if n == 1:
                num_decodes += 1
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                pos = range(start, start + n)
                positions.extend(pos)
                slots.extend(table[p // bs] * bs + p % bs for p in pos)
            starts.append(starts[-1] + n)
            seq_lens.append(start + n)
            tables.append(table)
            if item.completes:
                logits_rows.append(starts[-1] - 1)
                sampling_idx.append(i)
        width = max((len(t) for t in tables), default=0)
        dev = self.device
        block_tables = torch.zeros((len(tables), width), dtype=torch.int32)
        for r, t in enumerate(tables):
            block_tables[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
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
        return StepBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=meta,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            sampling_seq_idx=sampling_idx,
            token_counts=[item.num_new_tokens for item in out.scheduled],
        )

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        kv: KVBlockManager,
        lora: LoRAHook | None = None,
        lora_slots: list[int] | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Run the step; return logits ``[num_sampling_seqs, vocab]`` and their seq indices.

        ``lora_slots`` gives each scheduled sequence's adapter slot (-1 = base); the
        hook receives per-token slots through ``self.lora_meta`` for this step.
        """
        if out.block_copies:
            src = torch.tensor([c.src for c in out.block_copies], dtype=torch.long, device=self.device)
            dst = torch.tensor([c.dst for c in out.block_copies], dtype=torch.long, device=self.device)
            self.attn.copy_blocks(self.kv_cache.all_tensors, src, dst)
        batch = self.build_batch(out, kv)
        self.lora_meta: LoRAMetadata | None = None
        if lora is not None and lora_slots is not None:
            token_slots: list[int] = []
            for slot, n in zip(lora_slots, batch.token_counts, strict=True):
                token_slots.extend([slot] * n)
            self.lora_meta = LoRAMetadata.from_token_slots(token_slots, self.device)
            if self.lora_meta.num_active_slots == 0:
                lora = None
        hidden = self.model(batch.input_ids, batch.positions, self.kv_cache, batch.meta, self.attn, lora)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return logits, batch.sampling_seq_idx
