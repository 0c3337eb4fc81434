"""Continue a prefix-cache hit from the lower tiers: promote host/disk blocks into device blocks.

The device lookup (``KVBlockManager.get_computed_blocks``) stops at the first block the
accelerator pool does not hold. The blocks after it may have been demoted to host RAM
or disk; a promotion brings that run back, in order, into fresh device blocks, and
publishes each one in the device prefix cache only after its data landed, so the
caller's next lookup finds a longer hit. In two steps, so that disk reads run on the
tier's I/O workers while the engine keeps stepping other sequences::

    run = tiered_continuation(kv, tiers, seq_id, hit)   # the next keys host/disk hold
    pending = start_promotion(kv, tiers, hit, run)      # device blocks reserved, copies started
    ... later steps, while pending.ready() is False ...
    finish_promotion(kv, pending)                       # data in place: blocks become findable
    hit = kv.get_computed_blocks(seq_id, tokens, extra) # now includes the promoted run

A transfer that fails ends the run (a counted miss in the tier's metrics, never a hit);
the rest of the prompt is computed as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.kernels.metadata import PAD_BLOCK_ID
from loraplex.storage.kv.block_hash import BlockKey
from loraplex.storage.kv.block_manager import KVBlockManager
from loraplex.storage.kv.prefix_cache import PrefixHit
from loraplex.storage.kv.tiers.manager import TierManager
from loraplex.storage.kv.tiers.transfers import Promotion


@dataclass
class PendingPromotion:
    """Blocks on their way up for a waiting sequence: its device blocks are reserved (held by
    the pool's promotion state, not findable) until ``finish_promotion``."""

    promotion: Promotion
    block_ids: list[int]

    def ready(self) -> bool:
        """True when ``finish_promotion`` would not wait for disk reads."""
        return self.promotion.done()

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until the disk reads are done (or ``timeout_s``); True if they are."""
        return self.promotion.wait_ready(timeout_s)


def tiered_continuation(kv: KVBlockManager, tiers: TierManager, seq_id: int, hit: PrefixHit) -> list[bytes]:
    """The keys after ``hit`` that host/disk hold, in order up to the first they do not."""
    keys = kv.block_keys(seq_id)[hit.num_cached_blocks : hit.num_cacheable_blocks]
    return [key for key, _location in tiers.lookup(keys)] if keys else []


def start_promotion(
    kv: KVBlockManager, tiers: TierManager, hit: PrefixHit, run: Sequence[bytes]
) -> PendingPromotion | None:
    """Start bringing up ``run`` (from ``tiered_continuation``), the blocks that continue ``hit``.

    Host blocks are copied now (DMA on CUDA); disk reads start on the I/O workers.
    Device blocks are allocated for as many as fit; the rest stay where they are.
    None if ``run`` is empty.
    """
    if not run:
        return None
    promotion = tiers.prefetch(run)
    block_ids: list[int] = []
    try:
        # Hold the device blocks of the hit while allocating: free and least recently used,
        # they would be the first evicted to make room for the blocks that continue them.
        # (PAD entries of a sliding-window hit hold no block.)
        held_ids = [b for b in hit.block_ids if b != PAD_BLOCK_ID]
        taken = 0
        try:
            for held in held_ids:
                kv.pool.take(held)
                taken += 1
            for key, owner in zip(promotion.keys, promotion.owners, strict=True):
                block_id = kv.pool.allocate_for_key(BlockKey(key), owner)
                if block_id is None:  # no free device block left: promote what fits
                    break
                block_ids.append(block_id)
        finally:
            # Back to the free queue (if nobody else holds them) as its most recent entries,
            # the head of the prefix last, so the hit stays valid and is evicted last.
            for held in reversed(held_ids[:taken]):
                kv.pool.decref(held)
        promotion.assign(block_ids)
    except BaseException:
        # Nothing half-done stays behind: device blocks released, keys back in their tier.
        for block_id in block_ids:
            kv.pool.cancel_promoted(block_id)
        promotion.cancel()
        raise
    return PendingPromotion(promotion, block_ids)


def finish_promotion(kv: KVBlockManager, pending: PendingPromotion) -> int:
    """Wait for what is still in flight, publish the blocks that landed; return how many.

    If the promotion fails (not a disk fault, which is a counted miss: a bug, a device copy
    that raised), its device blocks are released and the error is raised.
    """
    try:
        result = pending.promotion.wait()
    except BaseException:
        for block_id in pending.block_ids:
            kv.pool.cancel_promoted(block_id)
        raise
    for block_id in result.block_ids:
        kv.pool.publish_promoted(block_id)
    for block_id in pending.block_ids[result.num_loaded :]:
        kv.pool.cancel_promoted(block_id)
    return result.num_loaded
