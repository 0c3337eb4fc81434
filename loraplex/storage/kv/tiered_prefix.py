"""Continue a prefix-cache hit from the lower tiers: promote host/disk blocks into device blocks.

The device lookup (``KVBlockManager.get_computed_blocks``) stops at the first block the
accelerator pool does not hold. The blocks after it may have been demoted to host RAM
or disk; ``promote_prefix`` brings that run back, in order, into fresh device blocks,
and publishes each one in the device prefix cache only after its data landed, so the
caller's next lookup finds a longer hit::

    hit = kv.get_computed_blocks(seq_id, tokens, extra)
    if promote_prefix(kv, tiers, seq_id, hit):
        hit = kv.get_computed_blocks(seq_id, tokens, extra)   # now includes the promoted run

A transfer that fails ends the run (a counted miss in the tier's metrics, never a
hit); the rest of the prompt is computed as usual.
"""

from __future__ import annotations

from loraplex.storage.kv.block_hash import BlockKey
from loraplex.storage.kv.block_manager import KVBlockManager
from loraplex.storage.kv.prefix_cache import PrefixHit
from loraplex.storage.kv.tier_manager import TierManager


def promote_prefix(kv: KVBlockManager, tiers: TierManager, seq_id: int, hit: PrefixHit) -> int:
    """Promote the blocks that continue ``hit`` from host/disk; return how many landed.

    Waits for disk reads before returning (the engine thread plans the step while
    the host copies and disk reads run on the tier's workers; it needs the data before
    the forward that reads it).
    """
    keys = kv.block_keys(seq_id)[hit.num_cached_blocks : hit.num_cacheable_blocks]
    run = [key for key, _location in tiers.lookup(keys)] if keys else []
    if not run:
        return 0
    promotion = tiers.prefetch(run)
    block_ids: list[int] = []
    for key in promotion.keys:
        block_id = kv.pool.allocate_for_key(BlockKey(key))
        if block_id is None:  # no free device block left: promote what fits
            break
        block_ids.append(block_id)
    promotion.assign(block_ids)
    result = promotion.wait()
    for block_id in result.block_ids:
        kv.pool.publish_promoted(block_id)
    for block_id in block_ids[result.num_loaded :]:
        kv.pool.cancel_promoted(block_id)
    return result.num_loaded
