"""Continuous batching with a per-step token budget, chunked prefill and preemption.

Each step fills a token budget (``max_num_batched_tokens``): running sequences
first, in admission order (a decode costs one token, an unfinished prefill takes a
chunk of what is left), then waiting sequences are admitted while the budget,
``max_num_seqs`` and free KV blocks allow. Sequences are not split into prefill
and decode phases: each just has ``num_computed_tokens`` out of ``num_tokens``,
which makes chunked prefill, recompute after preemption and decodes one mechanism.

When a running sequence cannot get a block, the lowest-priority running sequence
(the most recently admitted under FCFS) is preempted: its blocks are freed and it
goes back to the front of the waiting queue. Its full blocks stay in the prefix cache
(and its tiers); its partial last block is swapped out or recomputed, as
``PreemptionPolicy`` decides (``preemption_mode``).

Lower tiers never stall a step: when a waiting sequence's cached prefix continues in
host RAM or on disk, the promotion starts (host copies at once, disk reads on the
tier's workers) and the sequence waits, without holding up the sequences behind it,
until its blocks have landed; only when nothing else can run does ``schedule`` block
on the reads.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loraplex.platform.engine.preemption import PreemptionPolicy, SwappedTail
from loraplex.platform.engine.sequence import SeqStatus, Sequence
from loraplex.storage.kv.block_manager import AllocStatus, BlockCopy, KVBlockManager
from loraplex.storage.kv.prefix_cache import NO_HIT, PrefixHit
from loraplex.storage.kv.tier_manager import TierManager
from loraplex.storage.kv.tiered_prefix import PendingPromotion, finish_promotion, start_promotion

logger = logging.getLogger(__name__)


class AdmitDecision(enum.Enum):
    """What an admission hook (the adapter runtime) says about a waiting sequence."""

    OK = "ok"  # admit (the hook has reserved what it needs, e.g. pinned an adapter slot)
    WAIT = "wait"  # not now; later sequences may still be admitted
    REJECT = "reject"  # never (e.g. its adapter was removed): finish it as aborted


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
    aborted: list[Sequence] = field(default_factory=list)  # rejected at admission

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    policy: str = "fcfs"
    # Keep a few blocks free when admitting new work, so the running set does not
    # preempt itself on the very next step (vLLM's watermark).
    watermark_blocks: int = 0


class Scheduler:
    """Owns the waiting and running queues and the KV block manager."""

    def __init__(
        self,
        limits: SchedulerLimits,
        block_manager: KVBlockManager,
        admit_hook: Callable[[Sequence], AdmitDecision] | None = None,
        release_hook: Callable[[Sequence], None] | None = None,
        tiers: TierManager | None = None,
        preemption: PreemptionPolicy | None = None,
    ) -> None:
        self.limits = limits
        self.kv = block_manager
        # Host/disk KV tiers below the pool: a prefix hit continues there (promotion).
        self.tiers = tiers
        self.preemption = preemption
        # Promotions in flight for waiting sequences (by seq_id), and those whose
        # sequence ended meanwhile (finished once their reads land: the blocks stay cached).
        self._promotions: dict[int, PendingPromotion] = {}
        self._orphan_promotions: list[PendingPromotion] = []
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        # Hooks let the adapter manager veto admission (no free slot) and learn
        # when a sequence stops using its adapter; None = no LoRA.
        self._admit_hook = admit_hook
        self._release_hook = release_hook
        self.num_preemptions = 0
        self.num_swapped_out = 0  # preemptions whose partial tail went to the tiers
        self.num_swapped_in = 0  # ... and came back without recomputation
        self.num_swaps_lost = 0  # ... and were discarded (a block lost, a failed read)

    # -- queue management --------------------------------------------------------
    def _order_key(self, seq: Sequence) -> tuple[int, float, int]:
        req = seq.request
        prio = req.priority if self.limits.policy == "priority" else 0
        return (prio, req.arrival_time, seq.index)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        if self.limits.policy == "priority":
            self.waiting.sort(key=self._order_key)

    def add_running(self, seq: Sequence) -> None:
        """Admit a forked sibling straight into the running set (it shares KV already)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self.running.sort(key=self._order_key)

    def finish(self, seq: Sequence, status: SeqStatus) -> None:
        """Mark ``seq`` finished and free its blocks; safe to call from any queue."""
        was_running = seq in self.running
        if was_running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if was_running and self._release_hook is not None:
            self._release_hook(seq)
        seq.status = status
        self.kv.free(seq.seq_id)
        self._drop_swap(seq)
        pending = self._promotions.pop(seq.seq_id, None)
        if pending is not None:
            self._orphan_promotions.append(pending)

    def abort(self, seqs: Iterable[Sequence]) -> None:
        for seq in list(seqs):
            if not seq.status.finished:
                self.finish(seq, SeqStatus.FINISHED_ABORTED)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_promotions_in_flight(self) -> int:
        return len(self._promotions) + len(self._orphan_promotions)

    def drain(self) -> None:
        """Finish every transfer in flight (waiting for disk reads): before a shutdown."""
        for seq_id in list(self._promotions):
            finish_promotion(self.kv, self._promotions.pop(seq_id))
        self._finish_orphans(block=True)
        for seq in self.waiting:
            self._drop_swap(seq)

    # -- the step ----------------------------------------------------------------
    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free ``seq``'s KV (its partial tail swapped out, if the policy says so) and put it
        back at the head of the waiting queue."""
        self.running.remove(seq)
        if self._release_hook is not None:
            self._release_hook(seq)
        self._swap_out_tail(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.insert(0, seq)
        if self.limits.policy == "priority":
            self.waiting.sort(key=self._order_key)
        out.preempted.append(seq)
        self.num_preemptions += 1
        logger.debug("preempted seq %d (request %s)", seq.seq_id, seq.request.request_id)

    def _victim(self, seq: Sequence, scheduled: dict[int, ScheduledSeq]) -> Sequence:
        """Whom to preempt so ``seq`` can run: the lowest-priority, newest running
        sequence not already in this step; ``seq`` itself if that one outranks it."""
        candidates = [s for s in self.running if s.seq_id not in scheduled and s is not seq]
        if not candidates:
            return seq
        victim = max(candidates, key=self._order_key)
        return seq if self._order_key(victim) < self._order_key(seq) else victim

    # -- swap preemption ---------------------------------------------------------
    def _swap_out_tail(self, seq: Sequence) -> None:
        """Copy the computed blocks of ``seq`` that carry no prefix-cache key (its partial
        last block) to the tiers, if the policy prefers that to recomputing them."""
        if self.tiers is None or self.preemption is None or not self.kv.enable_prefix_caching:
            return
        bs = self.kv.block_size
        computed = seq.num_computed_tokens
        first = computed // bs  # full blocks before it are keyed: the prefix cache keeps them
        table = self.kv.block_table(seq.seq_id)
        tail = table[first : -(-computed // bs)]
        if not tail or not self.preemption.should_swap(computed - first * bs, len(tail)):
            return
        start = time.perf_counter()
        handle = self.tiers.swap_out(tail)
        self.preemption.observe_copy(
            len(tail) * self.tiers.layout.bytes_per_block, time.perf_counter() - start
        )
        if handle is not None:  # None: the tiers are full, recompute instead
            seq.swapped = SwappedTail(handle, first, computed)
            self.num_swapped_out += 1

    def _drop_swap(self, seq: Sequence) -> None:
        """Free what ``seq`` has swapped out (it ended, or its swap can no longer be used)."""
        swapped, seq.swapped = seq.swapped, None
        if swapped is None or self.tiers is None:
            return
        if swapped.swap_in is not None:
            swapped.swap_in.cancel()
        else:
            self.tiers.discard_swap(swapped.handle)

    def _swap_in_ready(self, seq: Sequence) -> bool:
        """Start bringing ``seq``'s swapped tail up (disk reads run meanwhile); True when it can be placed."""
        swapped = seq.swapped
        if swapped is None or self.tiers is None:
            return True
        if swapped.swap_in is None:
            swapped.swap_in = self.tiers.swap_in(swapped.handle)
        return swapped.swap_in.done()

    def _place_swapped_tail(self, seq: Sequence, swapped: SwappedTail) -> bool:
        """Write the swapped tail into the blocks just allocated for it; True if every block landed."""
        assert swapped.swap_in is not None and self.preemption is not None and self.tiers is not None
        table = self.kv.block_table(seq.seq_id)
        start = time.perf_counter()
        # Only the blocks still held by a tier started: a shorter run is incomplete (recompute).
        swapped.swap_in.assign(table[swapped.first_block : swapped.first_block + swapped.swap_in.num_started])
        result = swapped.swap_in.wait()
        moved = result.num_loaded * self.tiers.layout.bytes_per_block
        self.preemption.observe_copy(moved, time.perf_counter() - start)
        return result.complete

    def _prefix_still_held(self, seq: Sequence, hit: PrefixHit, swapped: SwappedTail) -> bool:
        """True if the blocks between ``hit`` and the swapped tail all wait in the tiers."""
        if self.tiers is None or hit.num_cached_blocks > swapped.first_block:
            return False
        keys = self.kv.block_keys(seq.seq_id)[hit.num_cached_blocks : swapped.first_block]
        tiers, pool = self.tiers, self.kv.pool
        return all(
            pool.lookup(k) is not None or tiers.is_moving(k) or tiers.location(k) is not None for k in keys
        )

    # -- prefix hits and promotions ---------------------------------------------
    def _finish_orphans(self, block: bool = False) -> None:
        keep = []
        for pending in self._orphan_promotions:
            if block or pending.ready():
                finish_promotion(self.kv, pending)
            else:
                keep.append(pending)
        self._orphan_promotions = keep

    def _prefix_hit(self, seq: Sequence) -> PrefixHit | None:
        """The cached head of ``seq``'s tokens: device blocks, continued from host/disk.

        None while blocks of it are on their way up (the sequence waits; nothing was taken).
        """
        extra = seq.request.cache_extra_keys
        pending = self._promotions.get(seq.seq_id)
        if pending is not None:
            if not pending.ready():
                return None
            finish_promotion(self.kv, self._promotions.pop(seq.seq_id))
        hit = self.kv.get_computed_blocks(seq.seq_id, seq.token_ids, extra)
        if self.tiers is None or hit.num_cached_blocks >= hit.num_cacheable_blocks:
            return hit
        keys = self.kv.block_keys(seq.seq_id)[hit.num_cached_blocks : hit.num_cacheable_blocks]
        if self.tiers.is_moving(keys[0]):
            return None  # another sequence's promotion is bringing this prefix up: share it
        held = len(self.tiers.lookup(keys))
        if held == 0:
            return hit
        # Promote only what could be admitted right after: blocks promoted for a sequence
        # that then waits for memory would be evicted (and demoted) again by the running
        # ones, step after step. Until then it waits; idle, the whole pool is free.
        reach = min(
            seq.num_tokens,
            (hit.num_cached_blocks + held) * self.kv.block_size + self.limits.max_num_batched_tokens,
        )
        if self.kv.can_allocate(seq.seq_id, reach, hit) is not AllocStatus.OK:
            return None
        pending = start_promotion(self.kv, self.tiers, seq.seq_id, hit)
        if pending is None:
            return hit
        if not pending.ready():
            self._promotions[seq.seq_id] = pending
            return None
        if finish_promotion(self.kv, pending) > 0:
            # Promotion allocated device blocks (which may evict others): look again.
            hit = self.kv.get_computed_blocks(seq.seq_id, seq.token_ids, extra)
        return hit

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Blocks on lower-tier reads only when nothing else could run."""
        self._finish_orphans()
        out = self._schedule_once()
        while out.is_empty and not out.aborted and self._wait_for_a_transfer():
            out = self._schedule_once()  # everyone left was waiting for blocks from host/disk
        return out

    def _wait_for_a_transfer(self) -> bool:
        """Block on the first waiting sequence's unfinished read; False if none is in flight."""
        for seq in self.waiting:
            pending = self._promotions.get(seq.seq_id)
            if pending is not None and not pending.ready():
                pending.wait_ready()
                return True
            swap_in = seq.swapped.swap_in if seq.swapped is not None else None
            if swap_in is not None and not swap_in.done():
                swap_in.wait_ready()
                return True
        return False

    def _schedule_once(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.limits.max_num_batched_tokens
        scheduled: dict[int, ScheduledSeq] = {}

        # 1. Running sequences, in admission order.
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new <= 0:
                continue
            copies = self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            while copies is None:
                victim = self._victim(seq, scheduled)
                self._preempt(victim, out)
                if victim is seq:
                    break
                copies = self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            if copies is None:
                continue
            out.block_copies.extend(copies)
            scheduled[seq.seq_id] = ScheduledSeq(seq, num_new, tuple(self.kv.block_table(seq.seq_id)))
            budget -= num_new

        # 2. Admit waiting sequences (not in a step that had to preempt: memory is tight).
        #    Memory is strictly FCFS (a sequence that does not fit stops admission), but
        #    a sequence whose adapter has no slot yet is skipped so it never blocks
        #    requests for resident adapters or the base model.
        if not out.preempted:
            for seq in list(self.waiting):
                if budget <= 0:
                    break
                width = 1 if seq.request.forked else seq.request.params.n
                if len(self.running) + width > self.limits.max_num_seqs:
                    break
                # Prefix cache: full blocks someone computed before (same tokens, same
                # adapter version, same tenant) are shared instead of recomputed. Nothing
                # may allocate KV between this lookup and allocate_slots below.
                if not self._swap_in_ready(seq):
                    continue  # its swapped tail is being read back; later sequences may run
                hit = self._prefix_hit(seq) if seq.num_computed_tokens == 0 else NO_HIT
                if hit is None:
                    continue  # its prefix is on its way up from host/disk
                cached = hit.num_cached_tokens
                swapped = seq.swapped
                if swapped is not None and hit.num_cached_blocks != swapped.first_block:
                    if self._prefix_still_held(seq, hit, swapped):
                        continue  # the rest of its prefix is still coming back: the tail stays useful
                    self._drop_swap(seq)  # a block before the tail was lost: recompute from the hit
                    self.num_swaps_lost += 1
                    swapped = None
                resume = swapped.num_computed_tokens if swapped is not None else cached
                num_new = min(seq.num_tokens - resume, budget)
                # Blocks for everything from the hit on: the swapped tail lands in the first.
                status = self.kv.can_allocate(seq.seq_id, resume + num_new, hit)
                if status is AllocStatus.NEVER:
                    # Only reachable if the pool shrank after add-time validation.
                    self.finish(seq, SeqStatus.FINISHED_ABORTED)
                    out.aborted.append(seq)
                    logger.error("seq %d can never fit the KV pool; aborted", seq.seq_id)
                    continue
                needed = self.kv.num_new_blocks_needed(seq.seq_id, cached, resume + num_new - cached, hit)
                if status is AllocStatus.LATER or (
                    self.kv.num_free_blocks - needed < self.limits.watermark_blocks and self.running
                ):
                    break
                if self._admit_hook is not None:
                    decision = self._admit_hook(seq)
                    if decision is AdmitDecision.WAIT:
                        continue
                    if decision is AdmitDecision.REJECT:
                        self.finish(seq, SeqStatus.FINISHED_ABORTED)
                        out.aborted.append(seq)
                        continue
                copies = self.kv.allocate_slots(seq.seq_id, cached, resume + num_new - cached, hit)
                assert copies is not None, "can_allocate said OK"
                seq.num_computed_tokens = cached
                if swapped is not None:
                    seq.swapped = None
                    if self._place_swapped_tail(seq, swapped):
                        seq.num_computed_tokens = resume
                        self.num_swapped_in += 1
                    else:  # a read failed (a counted miss): compute from the hit, within budget
                        num_new = min(seq.num_tokens - cached, num_new)
                        self.num_swaps_lost += 1
                if seq.num_preemptions == 0 and seq.index == 0:
                    seq.request.num_cached_tokens = min(cached, seq.num_prompt_tokens)
                self.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                out.block_copies.extend(copies)
                scheduled[seq.seq_id] = ScheduledSeq(seq, num_new, tuple(self.kv.block_table(seq.seq_id)))
                budget -= num_new

        # Decodes (one query token) first: backends batch them with one kernel.
        items = list(scheduled.values())
        out.scheduled = [s for s in items if s.num_new_tokens == 1] + [
            s for s in items if s.num_new_tokens > 1
        ]
        return out
