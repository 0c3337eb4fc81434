"""What admission and preemption ask of the KV tiers: prefix hits continued from host/disk,
promotions in flight, and swapped tails.

The scheduler decides who runs; this module answers, per waiting sequence, what of its
KV already exists and where, and moves it:

    prefix_hit(seq)            device hit, continued from host/disk by a promotion; None while
                               the promotion's disk reads are in flight (the sequence waits)
    swap_out_tail(seq)         at preemption: the partial last block to the tiers (policy)
    swap_in_ready(seq)         at re-admission: start reading the tail back; True when placed-able
    place_swapped_tail(...)    after allocation: write the tail into its fresh block
    forget(seq)                the sequence ended: free its tail, orphan its promotion
    wait_for_a_transfer(...)   nothing else can run: block on the oldest read
    drain(waiting)             before a shutdown: every transfer lands

Promotions whose sequence ended are still finished when their reads land (the blocks
become cached like any other). Without tiers every method is a no-op around the device
lookup.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterable

from loraplex.platform.engine.preemption import PreemptionPolicy, SwappedTail
from loraplex.platform.engine.sequence import Sequence
from loraplex.storage.kv.block_manager import AllocStatus
from loraplex.storage.kv.prefix_cache import PrefixHit
from loraplex.storage.kv.tiers.manager import TierManager
from loraplex.storage.kv.tiers.prefix_promotion import (
    PendingPromotion,
    finish_promotion,
    start_promotion,
    tiered_continuation,
)
from loraplex.storage.kv.tiers.tiered_kv import TieredKV

logger = logging.getLogger(__name__)


class Wait(enum.Enum):
    """A waiting sequence whose KV is still on its way up: try it again next step."""

    PREFIX = "prefix"


class TierAdmission:
    """The scheduler's view of the tiers below the accelerator pool (see the module docstring)."""

    def __init__(
        self, cache: TieredKV, preemption: PreemptionPolicy | None, max_num_batched_tokens: int
    ) -> None:
        self._cache = cache
        self.kv = cache.block_manager
        self.preemption = preemption
        self.max_num_batched_tokens = max_num_batched_tokens
        # Promotions in flight for waiting sequences (by seq_id), and those whose
        # sequence ended meanwhile (finished once their reads land: the blocks stay cached).
        self._promotions: dict[int, PendingPromotion] = {}
        self._orphans: list[PendingPromotion] = []
        self.num_swapped_out = 0  # preemptions whose partial tail went to the tiers
        self.num_swapped_in = 0  # ... and came back without recomputation
        self.num_swaps_lost = 0  # ... and were discarded (a block lost, a failed read)

    @property
    def tiers(self) -> TierManager | None:
        """The cache's host/disk tiers; None without them, or once ``TieredKV.persist`` closed them."""
        return self._cache.tiers

    @property
    def num_promotions_in_flight(self) -> int:
        return len(self._promotions) + len(self._orphans)

    # -- prefix hits and promotions ---------------------------------------------
    def prefix_hit(self, seq: Sequence) -> PrefixHit | None:
        """The cached head of ``seq``'s tokens: device blocks, continued from host/disk.

        None while blocks of it are on their way up (the sequence waits; nothing was taken).
        """
        extra = seq.request.cache_extra_keys
        pending = self._promotions.get(seq.seq_id)
        if pending is not None:
            if not pending.ready():
                return None
            finish_promotion(self.kv, self._promotions.pop(seq.seq_id))
        hit = self.kv.get_computed_blocks(
            seq.seq_id, seq.token_ids, extra, seq.request.cache_owner, seq.request.cache_origin
        )
        if self.tiers is None or hit.num_cached_blocks >= hit.num_cacheable_blocks:
            return hit
        if self.tiers.is_moving(self.kv.block_keys(seq.seq_id)[hit.num_cached_blocks]):
            return None  # another sequence's promotion is bringing this prefix up: share it
        run = tiered_continuation(self.kv, self.tiers, seq.seq_id, hit)
        if not run:
            return hit
        # Promote only what could be admitted right after: blocks promoted for a sequence
        # that then waits for memory would be evicted (and demoted) again by the running
        # ones, step after step. Until then it waits; idle, the whole pool is free.
        reach = min(
            seq.num_tokens,
            (hit.num_cached_blocks + len(run)) * self.kv.block_size + self.max_num_batched_tokens,
        )
        if self.kv.can_allocate(seq.seq_id, reach, hit) is not AllocStatus.OK:
            if self.kv.num_blocks_for(reach) > self.kv.num_blocks:
                # Only with a sliding window (a sequence longer than the pool): the hit and the
                # run could never be held at once, so waiting would never end. Compute past
                # the device hit instead (the window frees blocks as it goes).
                return hit
            return None
        pending = start_promotion(self.kv, self.tiers, hit, run)
        assert pending is not None, "a non-empty run starts a promotion"
        if not pending.ready():
            self._promotions[seq.seq_id] = pending
            return None
        if finish_promotion(self.kv, pending) > 0:
            # Promotion allocated device blocks (which may evict others): look again.
            hit = self.kv.get_computed_blocks(
                seq.seq_id, seq.token_ids, extra, seq.request.cache_owner, seq.request.cache_origin
            )
        return hit

    def finish_orphans(self, block: bool = False) -> None:
        """Publish the promotions whose sequence ended, once (or, with ``block``, as soon as) they land."""
        keep = []
        for pending in self._orphans:
            if block or pending.ready():
                finish_promotion(self.kv, pending)
            else:
                keep.append(pending)
        self._orphans = keep

    def wait_for_a_transfer(self, waiting: Iterable[Sequence]) -> bool:
        """Block on the first waiting sequence's unfinished read; False if none is in flight."""
        for seq in waiting:
            pending = self._promotions.get(seq.seq_id)
            if pending is not None and not pending.ready():
                pending.wait_ready()
                return True
            swap_in = seq.swapped.swap_in if seq.swapped is not None else None
            if swap_in is not None and not swap_in.done():
                swap_in.wait_ready()
                return True
        # A waiting sequence may be waiting for the prefix an ended sequence's promotion brings.
        for pending in self._orphans:
            if not pending.ready():
                pending.wait_ready()
                self.finish_orphans()
                return True
        return False

    # -- swap preemption ---------------------------------------------------------
    def swap_out_tail(self, seq: Sequence) -> None:
        """Copy the computed blocks of ``seq`` that carry no prefix-cache key (its partial
        last block) to the tiers, if the policy prefers that to recomputing them."""
        if self.tiers is None or self.preemption is None or not self.kv.enable_prefix_caching:
            return
        bs = self.kv.block_size
        computed = seq.num_computed_tokens
        first = computed // bs  # full blocks before it are keyed: the prefix cache keeps them
        tail = self.kv.block_table(seq.seq_id)[first : -(-computed // bs)]
        if not tail or not self.preemption.should_swap(computed - first * bs, len(tail)):
            return
        start = time.perf_counter()
        try:
            handle = self.tiers.swap_out(tail)
        except Exception:
            # Swapping is only cheaper than recomputing: a copy that fails costs the tokens.
            logger.exception("swapping out seq %d's tail failed; it will be recomputed", seq.seq_id)
            return
        self.preemption.observe_copy(len(tail), time.perf_counter() - start)
        if handle is not None:  # None: the tiers are full, recompute instead
            seq.swapped = SwappedTail(handle, first, computed)
            self.num_swapped_out += 1

    def drop_swap(self, seq: Sequence, *, lost: bool = False) -> None:
        """Free what ``seq`` has swapped out (it ended, or, ``lost``, the tail can no longer be used)."""
        swapped, seq.swapped = seq.swapped, None
        if swapped is None or self.tiers is None:
            return
        self.num_swaps_lost += lost
        if swapped.swap_in is not None:
            swapped.swap_in.cancel()
        else:
            self.tiers.discard_swap(swapped.handle)

    def swap_in_ready(self, seq: Sequence) -> bool:
        """Start bringing ``seq``'s swapped tail up (disk reads run meanwhile); True when it can be placed."""
        swapped = seq.swapped
        if swapped is None or self.tiers is None:
            return True
        if swapped.swap_in is None:
            swapped.swap_in = self.tiers.swap_in(swapped.handle)
        return swapped.swap_in.done()

    def usable_swap(self, seq: Sequence, hit: PrefixHit) -> SwappedTail | Wait | None:
        """The swapped tail that continues ``hit``; None if there is none (or it was lost: freed
        here, recompute); ``Wait.PREFIX`` while the blocks before it are still coming back."""
        swapped = seq.swapped
        if swapped is None or hit.num_cached_blocks == swapped.first_block:
            return swapped
        if self._prefix_still_held(seq, hit, swapped):
            return Wait.PREFIX
        self.drop_swap(seq, lost=True)  # a block before the tail was lost: recompute from the hit
        return None

    def place_swapped_tail(self, seq: Sequence, swapped: SwappedTail) -> bool:
        """Write the swapped tail into the blocks just allocated for it; True if every block landed."""
        assert swapped.swap_in is not None and self.preemption is not None and self.tiers is not None
        seq.swapped = None
        table = self.kv.block_table(seq.seq_id)
        start = time.perf_counter()
        # Only the blocks still held by a tier started: a shorter run is incomplete (recompute).
        try:
            swapped.swap_in.assign(
                table[swapped.first_block : swapped.first_block + swapped.swap_in.num_started]
            )
            result = swapped.swap_in.wait()
        except BaseException:
            swapped.swap_in.cancel()  # a no-op if the wait ended it: nothing stays pinned or hidden
            self.num_swaps_lost += 1
            raise
        self.preemption.observe_copy(result.num_loaded, time.perf_counter() - start)
        if result.complete:
            self.num_swapped_in += 1
        else:
            self.num_swaps_lost += 1
        return result.complete

    def _prefix_still_held(self, seq: Sequence, hit: PrefixHit, swapped: SwappedTail) -> bool:
        """True if the blocks between ``hit`` and the swapped tail are all still somewhere."""
        if self.tiers is None or hit.num_cached_blocks > swapped.first_block:
            return False
        keys = self.kv.block_keys(seq.seq_id)[hit.num_cached_blocks : swapped.first_block]
        tiers, pool = self.tiers, self.kv.pool
        return all(
            pool.lookup(k) is not None or tiers.is_moving(k) or tiers.location(k) is not None for k in keys
        )

    # -- lifecycle ----------------------------------------------------------------
    def forget(self, seq: Sequence) -> None:
        """``seq`` ended: free its swapped tail; its promotion in flight still lands (orphaned)."""
        self.drop_swap(seq)
        pending = self._promotions.pop(seq.seq_id, None)
        if pending is not None:
            self._orphans.append(pending)

    def drain(self, waiting: Iterable[Sequence]) -> None:
        """Land every transfer in flight (waiting for disk reads), free swapped tails: before a shutdown."""
        for seq_id in list(self._promotions):
            finish_promotion(self.kv, self._promotions.pop(seq_id))
        self.finish_orphans(block=True)
        for seq in waiting:
            self.drop_swap(seq)
