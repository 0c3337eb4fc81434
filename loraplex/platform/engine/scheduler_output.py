"""One step's plan (``SchedulerOutput``), as the scheduler hands it to the engine, the runner, the
adapter runtime and the output processor: which sequences run, how many of their tokens, on
which KV blocks, and which sequences the planning preempted or ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.platform.engine.sequence import Sequence
from loraplex.storage.kv.block_manager import BlockCopy


@dataclass(frozen=True)
class ScheduledSeq:
    """A sequence, how many of its uncomputed tokens run this step, and its KV blocks.

    ``block_ids`` is the sequence's block table after this step's allocation: the
    runner reads it instead of asking the block manager, so whoever hands out blocks
    (fresh, shared by a prefix-cache hit, promoted from a lower tier) is invisible to
    the model side.
    """

    seq: Sequence
    num_new_tokens: int
    block_ids: tuple[int, ...]
    num_draft: int = 0
    """Of ``num_new_tokens``, the speculative drafts at the end (every position returns logits)."""

    @property
    def completes(self) -> bool:
        """True when this step computes the sequence's last known token: it samples."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """One step's work: decodes (one new token) first, then prefill chunks."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Ended while planning: rejected at admission (an adapter removed) or failed (an error
    # planning it); ``request.error`` says why.
    aborted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
