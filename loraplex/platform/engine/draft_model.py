"""Speculative decoding with a draft model: a smaller model of the target's vocabulary proposes
``k`` tokens greedily, the target verifies them in one forward (``speculative.verify``).

The draft runs on its own ``ModelRunner`` over its own paged KV: the same ``KVCache`` layout
and block size as the target's, a pool of ``num_draft_kv_blocks`` blocks with a block table per
sequence. Its layers and heads differ from the target's, so its blocks cannot come from the
target's pool; ``num_draft_kv_blocks`` bounds its memory instead.

Per step, the sequences that speculate are proposed for together: one forward that catches each
draft KV up with its sequence (the prompt on the first step; afterwards the tokens the target
emitted since, usually 1 to ``k + 1``), then ``k - 1`` one-token forwards, each row taking the
draft's argmax. A draft is a point mass, so ``verify``'s rejection rule keeps the target's
distribution exact at any temperature.

Rollback: the draft KV of a sequence holds its tokens and the drafts fed back in. At the next
step the longest prefix it shares with the sequence's tokens (the target-confirmed ones) is
kept, and the rest is overwritten: rejected drafts' slots are simply written again. When the
pool runs short, the draft KV of the sequences not proposing this step goes first (least
recently used); a sequence that still does not fit decodes without drafts this step.

The draft runs on the base weights only (no LoRA): a request's adapter changes what the target
says, which lowers acceptance, never the tokens (vLLM's GPU path drafts the same way).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from loraplex.kernels.registry import (
    select_attention_backend,
    select_linear_backend,
    select_pointwise_backend,
)
from loraplex.platform.engine.config import EngineConfig, RuntimeInfo
from loraplex.platform.engine.runner import ModelRunner
from loraplex.platform.engine.sampler import greedy_tokens
from loraplex.platform.engine.sequence import Sequence
from loraplex.platform.engine.speculative import SpeculativeConfig
from loraplex.platform.model.arch import ModelArch
from loraplex.platform.model.loader import load_model
from loraplex.platform.model.packed_weights import resolve_quantization
from loraplex.platform.model.source import gguf_source, resolve_model_dir
from loraplex.storage.kv.kv_cache import KVCache, kv_bytes_per_block

logger = logging.getLogger(__name__)

DRAFT_KV_BYTES = 1 << 30
"""The most the default draft KV pool takes (``num_draft_kv_blocks`` unset)."""


@dataclass
class _DraftKV:
    """One sequence's tokens in the draft's KV (the ``TokenState`` the runner reads)."""

    token_ids: list[int] = field(default_factory=list)
    """The tokens fed (or to feed) the draft: the sequence's, then the drafts fed back."""
    num_computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    num_confirmed: int = 0
    """Leading tokens that were the sequence's own when last proposed for (never rolled back)."""
    last_used: int = 0

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


@dataclass(frozen=True)
class _DraftRow:
    """A draft forward's row: every row samples at its last position."""

    seq: _DraftKV
    num_new_tokens: int
    block_ids: tuple[int, ...]
    num_draft: int = 0
    completes: bool = True


class DraftModelProposer:
    """Greedy drafts from a smaller model, with a paged KV of its own (see the module docstring)."""

    def __init__(self, runner: ModelRunner, num_blocks: int) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._kv: dict[int, _DraftKV] = {}
        self._clock = 0
        self.num_forwards = 0
        """Draft forwards run (each proposes one token for every row)."""
        self.seconds_per_draft = 0.0
        """What one more draft costs: a one-token pass's time per row (smoothed; 0 before the
        first). The catch-up pass is left out: it pays for the tokens the target emitted, once."""

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """Up to ``k`` greedy draft tokens for each ``(sequence, k)`` that fits in the draft KV."""
        self._clock += 1
        proposing = {seq.seq_id for seq, _ in wants}
        active: list[tuple[int, _DraftKV, int]] = []
        for seq, k in wants:
            kv = self._catch_up(seq)
            # Positions written: the sequence's tokens, then the first k - 1 drafts fed back.
            if self._reserve(kv, len(seq.token_ids) + k - 1, proposing):
                active.append((seq.seq_id, kv, k))
        drafts: dict[int, list[int]] = {seq_id: [] for seq_id, _, _ in active}
        step = 0
        while active:
            # One-token rows first: the attention backends take the first ``num_decodes`` rows
            # as decodes (``AttentionMetadata``), as the scheduler orders a step.
            active.sort(key=lambda entry: entry[1].num_uncomputed != 1)
            rows = [_DraftRow(kv, kv.num_uncomputed, tuple(kv.blocks)) for _, kv, _ in active]
            started = time.perf_counter()
            logits, _ = self.runner.logits_for(rows)
            self.num_forwards += 1
            if all(row.num_new_tokens == 1 for row in rows):  # a pure draft pass: its cost per draft
                per_draft = (time.perf_counter() - started) / len(rows)
                weight = 0.1 if self.seconds_per_draft else 1.0
                self.seconds_per_draft += weight * (per_draft - self.seconds_per_draft)
            tokens = greedy_tokens(logits).tolist()
            step += 1
            still: list[tuple[int, _DraftKV, int]] = []
            for (seq_id, kv, k), tok in zip(active, tokens, strict=True):
                kv.num_computed_tokens = len(kv.token_ids)
                drafts[seq_id].append(int(tok))
                if step < k:
                    kv.token_ids.append(int(tok))
                    still.append((seq_id, kv, k))
            active = still
        return drafts

    def forget(self, seq_id: int) -> None:
        kv = self._kv.pop(seq_id, None)
        if kv is not None:
            self._free.extend(reversed(kv.blocks))

    def _catch_up(self, seq: Sequence) -> _DraftKV:
        """``seq``'s draft KV, rolled back to the longest prefix it shares with ``seq``'s tokens
        and extended with the tokens it lacks (computed by the next forward)."""
        kv = self._kv.get(seq.seq_id)
        if kv is None:
            kv = self._kv[seq.seq_id] = _DraftKV()
        tokens = seq.token_ids
        same = min(kv.num_confirmed, len(tokens))
        limit = min(len(kv.token_ids), len(tokens))
        while same < limit and kv.token_ids[same] == tokens[same]:
            same += 1
        # The last token always runs: its logits propose the first draft.
        kv.num_computed_tokens = min(kv.num_computed_tokens, same, len(tokens) - 1)
        del kv.token_ids[kv.num_computed_tokens :]
        kv.token_ids.extend(tokens[kv.num_computed_tokens :])
        kv.num_confirmed = len(tokens)
        kv.last_used = self._clock
        return kv

    def _reserve(self, kv: _DraftKV, num_positions: int, proposing: set[int]) -> bool:
        """Blocks for ``num_positions`` in ``kv``'s table, evicting the least recently used draft
        KV of sequences not proposing this step when short; False (nothing held) if they do not fit."""
        need = -(-num_positions // self.block_size) - len(kv.blocks)
        if need > len(self._free):
            idle = sorted(
                (other.last_used, seq_id) for seq_id, other in self._kv.items() if seq_id not in proposing
            )
            for _, seq_id in idle:
                if need <= len(self._free):
                    break
                self.forget(seq_id)
        if need > len(self._free):
            # Too long for the whole pool beside this step's others: start afresh next time.
            self._free.extend(reversed(kv.blocks))
            kv.blocks.clear()
            kv.token_ids.clear()
            kv.num_computed_tokens = kv.num_confirmed = 0
            return False
        for _ in range(max(0, need)):
            kv.blocks.append(self._free.pop())
        return True


def load_draft_proposer(
    spec: SpeculativeConfig, config: EngineConfig, info: RuntimeInfo, target: ModelArch
) -> DraftModelProposer:
    """Load ``spec.model`` beside the target (same device, dtype and block size) with its KV pool;
    ValueError when its vocabulary is not the target's."""
    assert spec.model is not None  # SpeculativeConfig.parse requires it for draft_model
    model_dir = resolve_model_dir(spec.model)
    gguf_path = gguf_source(spec.model)
    quantization = resolve_quantization(spec.quantization, gguf_path)
    device, dtype = info.device, info.dtype
    model, arch, _ = load_model(
        model_dir,
        dtype,
        device,
        info.max_model_len,
        select_linear_backend(config.linear_backend, device),
        select_pointwise_backend(device),
        quantization,
        gguf_path,
    )
    if arch.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config model {spec.model!r} has a vocabulary of {arch.vocab_size} tokens, the "
            f"target {target.vocab_size}: a draft model must share the target's tokenizer"
        )
    bs = config.block_size
    per_block = kv_bytes_per_block(arch.num_layers, bs, arch.num_kv_heads, arch.head_dim, dtype)
    num_blocks = spec.num_draft_kv_blocks
    if num_blocks is None:
        per_seq = -(-info.max_model_len // bs) + 1
        wanted = per_seq * (spec.disable_by_batch_size or config.max_num_seqs)
        num_blocks = max(per_seq, min(wanted, DRAFT_KV_BYTES // per_block))
    kv_cache = KVCache(arch.num_layers, num_blocks, bs, arch.num_kv_heads, arch.head_dim, dtype, device)
    runner = ModelRunner(model, kv_cache, select_attention_backend(config.attention_backend, device), device)
    logger.info(
        "draft model %s (%d layers, quantization %s): %d KV blocks (%.1f MiB), %d tokens per draft",
        model_dir.name,
        arch.num_layers,
        quantization,
        num_blocks,
        num_blocks * per_block / 2**20,
        spec.num_speculative_tokens,
    )
    return DraftModelProposer(runner, num_blocks)
