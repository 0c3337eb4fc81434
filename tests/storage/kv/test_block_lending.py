"""The block pool lends its top blocks to the adapter arena: keyless blocks go lowest id first,
lent blocks are never handed to a sequence, cached ones are demoted before they are lent."""

from __future__ import annotations

import pytest

from loraplex.storage.kv.block_manager import KVBlockManager
from loraplex.storage.kv.block_pool import BlockPool


def test_keyless_blocks_go_lowest_first_so_the_top_stays_free() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    pool.decref(1)
    assert [b.block_id for b in pool.allocate(2)] == [1, 3]  # the freed 1 before the fresh 3
    assert pool.lendable() == 4  # 4..7
    pool.check_integrity()


def test_lend_and_unlend_move_the_limit_and_conserve_blocks() -> None:
    m = KVBlockManager(num_blocks=8, block_size=2)
    m.allocate_slots(1, 0, 6)  # blocks 0, 1, 2
    pool = m.pool
    assert pool.lendable() == 5
    pool.lend(4)  # blocks 4..7
    assert pool.limit == 4 and pool.num_lent == 4 and pool.num_free_blocks == 1
    m.check_integrity()  # 3 used + 1 free + 4 lent = 8
    assert pool.lendable() == 1
    # A sequence gets the one free block, then nothing: the lent ones are not the KV's.
    assert m.allocate_slots(2, 0, 2) is not None and m.block_table(2) == [3]
    assert m.allocate_slots(3, 0, 2) is None
    with pytest.raises(RuntimeError, match="not all free"):
        pool.lend(1)  # block 3 is in use
    pool.unlend(2)  # blocks 4, 5 come back
    assert pool.limit == 6 and pool.num_free_blocks == 2
    assert m.allocate_slots(3, 0, 4) is not None and m.block_table(3) == [4, 5]
    with pytest.raises(RuntimeError, match="lent"):
        pool.unlend(3)
    m.check_integrity()
    pool.unlend(2)
    m.free(1)
    m.free(2)
    m.free(3)
    assert pool.num_free_blocks == 8 and pool.num_lent == 0
    m.check_integrity()


def test_a_cached_block_is_demoted_before_it_is_lent() -> None:
    m = KVBlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    evicted: list[int] = []
    m.pool.on_evict = lambda block_id, key, owner: evicted.append(block_id)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    hit = m.get_computed_blocks(1, tokens)
    assert m.allocate_slots(1, 0, 8, hit) is not None  # blocks 0..3
    m.cache_full_blocks(1, tokens, 8)
    m.free(1)  # all four free and cached
    assert m.pool.num_cached_blocks == 4 and m.pool.lendable() == 4
    m.pool.lend(2)
    assert evicted == [2, 3] and m.pool.num_cached_blocks == 2
    m.check_integrity()


def test_the_integrity_check_sees_a_lent_block_in_use() -> None:
    pool = BlockPool(4)
    pool.lend(2)
    pool.blocks[3].ref_cnt = 1  # a bug: something used a lent block
    with pytest.raises(AssertionError, match="lent block 3"):
        pool.check_integrity()
