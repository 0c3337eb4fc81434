"""``KVBlockManager.truncate``: speculative tokens rolled back give whole blocks back at once,
shared (forked) blocks only lose this sequence's reference, and nothing rejected is cached."""

from __future__ import annotations

from loraplex.storage.kv.block_manager import KVBlockManager


def test_truncate_frees_whole_rejected_blocks() -> None:
    bm = KVBlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    tokens = list(range(10, 30))
    hit = bm.get_computed_blocks(1, tokens[:9])
    assert bm.allocate_slots(1, 0, 9, hit) == []  # 9 tokens: 3 blocks
    bm.cache_full_blocks(1, tokens, 9)  # blocks 0 and 1 keyed
    assert bm.allocate_slots(1, 9, 6) == []  # 6 drafts: up to 15 tokens, 4 blocks
    assert len(bm.block_table(1)) == 4
    released = bm.truncate(1, 10)  # one draft accepted: 10 tokens need 3 blocks
    assert released == 1 and len(bm.block_table(1)) == 3
    assert bm.num_free_blocks == 13
    bm.cache_full_blocks(1, tokens[:11], 10)
    bm.check_integrity()
    # A fork shares the blocks; truncating one sibling leaves the other's intact.
    bm.fork(1, 2)
    assert bm.allocate_slots(2, 10, 6) is not None
    before = list(bm.block_table(1))
    bm.truncate(2, 4)
    assert bm.block_table(1) == before and len(bm.block_table(2)) == 1
    bm.check_integrity()
    bm.free(1)
    bm.free(2)
    bm.check_integrity()
    assert bm.num_free_blocks == 16
    assert bm.truncate(99, 0) == 0  # unknown sequence: nothing to do
