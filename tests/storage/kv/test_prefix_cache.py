"""Prefix caching in the block manager: exact block ids, LRU eviction order, isolation,
copy-on-write with cached blocks, admission accounting and promotion from a lower tier."""

from __future__ import annotations

import pytest

from loraplex.storage.kv.block_hash import BlockKey, ExtraKeys, block_keys, root_key
from loraplex.storage.kv.block_manager import AllocStatus, BlockCopy, KVBlockManager
from loraplex.storage.kv.prefix_cache import NO_HIT, PrefixHit

FP = b"test-model/bs"


def manager(num_blocks: int, block_size: int) -> KVBlockManager:
    return KVBlockManager(num_blocks, block_size, enable_prefix_caching=True, fingerprint=FP)


def keys_of(tokens: list[int], block_size: int, extra: ExtraKeys = ()) -> list[BlockKey]:
    return block_keys(tokens, block_size, root_key(FP), extra)


def admit(m: KVBlockManager, seq_id: int, tokens: list[int], extra: ExtraKeys = ()) -> PrefixHit:
    """What the scheduler does for a waiting sequence, then the step computing its whole prompt."""
    hit = m.get_computed_blocks(seq_id, tokens, extra)
    copies = m.allocate_slots(seq_id, hit.num_cached_tokens, len(tokens) - hit.num_cached_tokens, hit)
    assert copies == []
    m.cache_full_blocks(seq_id, tokens, len(tokens))
    m.check_integrity()
    return hit


def refs(m: KVBlockManager) -> list[int]:
    return [b.ref_cnt for b in m.pool.blocks]


@pytest.mark.parametrize(
    ("prompt_len", "hit_blocks", "second_table"),
    [
        (8, (0,), [0, 2]),  # exact multiple: the last block is recomputed for the last token's logits
        (9, (0, 1), [0, 1, 3]),  # one more: both full blocks hit
        (7, (0,), [0, 2]),  # one less: only the one full block exists
        (4, (), [1]),  # a single full block is never a hit
        (1, (), [1]),
    ],
)
def test_same_prompt_shares_full_blocks_except_what_the_last_token_needs(
    prompt_len: int, hit_blocks: tuple[int, ...], second_table: list[int]
) -> None:
    m = manager(16, 4)
    prompt = list(range(100, 100 + prompt_len))
    assert admit(m, 1, prompt) == NO_HIT._replace(
        num_query_tokens=prompt_len, num_cacheable_blocks=(prompt_len - 1) // 4
    )
    hit = admit(m, 2, prompt)
    assert hit.block_ids == hit_blocks
    assert hit.num_cached_tokens == 4 * len(hit_blocks)
    assert hit.keys == tuple(keys_of(prompt, 4)[: len(hit_blocks)])
    assert m.block_table(2) == second_table
    for block_id in hit_blocks:
        assert m.pool.blocks[block_id].ref_cnt == 2
    # The recomputed full block duplicates block 1's key: it stays private, not de-duplicated.
    if prompt_len == 8:
        assert m.pool.blocks[1].key == keys_of(prompt, 4)[1]
        assert m.pool.blocks[2].key is None


@pytest.mark.parametrize(
    ("extra_a", "extra_b"),
    [
        (("adapter-1", "tenant-a"), ("adapter-2", "tenant-a")),  # another adapter
        (("adapter-1", "tenant-a"), ("adapter-1", "tenant-b")),  # another tenant
        (("adapter-1",), ()),  # the base model
        (("ab", "c"), ("a", "bc")),  # would collide if concatenated without length prefixes
    ],
)
def test_other_extra_keys_never_hit(extra_a: ExtraKeys, extra_b: ExtraKeys) -> None:
    m = manager(16, 4)
    prompt = list(range(13))
    admit(m, 1, prompt, extra_a)
    assert admit(m, 2, prompt, extra_b).num_cached_tokens == 0
    assert admit(m, 3, prompt, extra_a).block_ids == (0, 1, 2)


def test_another_fingerprint_never_hits() -> None:
    a = KVBlockManager(8, 4, enable_prefix_caching=True, fingerprint=b"model-a")
    b = KVBlockManager(8, 4, enable_prefix_caching=True, fingerprint=b"model-b")
    admit(a, 1, list(range(9)))
    admit(b, 1, list(range(9)))
    assert a.pool.blocks[0].key != b.pool.blocks[0].key


def test_hits_after_free_in_lru_order_and_misses_after_reuse() -> None:
    m = manager(6, 2)
    evicted: list[tuple[int, BlockKey, int | None]] = []
    m.pool.on_evict = lambda block_id, key, owner: evicted.append((block_id, key, m.pool.lookup(key)))
    a, b, c = [1, 2, 3, 4, 5, 6], [11, 12, 13, 14], [21, 22, 23, 24, 25, 26]
    ka, kb = keys_of(a, 2), keys_of(b, 2)
    admit(m, 1, a)
    admit(m, 2, b)
    assert m.block_table(1) == [0, 1, 2] and m.block_table(2) == [3, 4]
    m.free(1)
    m.free(2)
    # Tail first: a sequence's head blocks are the last to be evicted.
    assert m.pool.free_block_ids() == [5, 2, 1, 0, 4, 3]
    assert m.pool.num_cached_blocks == 5

    # A again: its first two blocks are found in the free queue and leave it (ref 0 -> 1).
    hit = admit(m, 3, a)
    assert hit.block_ids == (0, 1)
    assert m.block_table(3) == [0, 1, 5]
    assert m.pool.free_block_ids() == [2, 4, 3]
    assert evicted == []

    # C takes the three oldest free blocks: each cached one is evicted, in LRU order,
    # and the key is already out of the index when on_evict runs.
    admit(m, 4, c)
    assert m.block_table(4) == [2, 4, 3]
    assert evicted == [(2, ka[2], None), (4, kb[1], None), (3, kb[0], None)]
    assert m.pool.num_evicted_blocks == 3

    # B's blocks were reused for C: a miss now, and B takes C's freed blocks (tail first).
    # A's head blocks are in use: a hit increfs them; its last block evicts C's head.
    m.free(4)
    assert m.pool.free_block_ids() == [3, 4, 2]
    assert admit(m, 5, b).block_ids == ()
    assert admit(m, 6, a).block_ids == (0, 1)
    assert m.block_table(5) == [3, 4] and m.block_table(6) == [0, 1, 2]
    assert refs(m) == [2, 2, 1, 1, 1, 1]
    kc = keys_of(c, 2)
    assert [e[:2] for e in evicted[3:]] == [(3, kc[2]), (4, kc[1]), (2, kc[0])]

    stats = m.prefix_cache_stats()
    assert (stats.num_queries, stats.num_hit_blocks, stats.num_hit_tokens) == (6, 4, 8)
    # Cacheable blocks per admission: 2, 1, 2, 2, 1, 2 -> 10, of which 4 hit.
    assert stats.num_miss_blocks == 6
    assert stats.num_query_tokens == 6 + 4 + 6 + 6 + 4 + 6
    assert (stats.num_evicted_blocks, stats.num_evicted_tokens) == (6, 12)


def test_admission_counts_free_cached_hits_as_taken() -> None:
    m = manager(4, 2)
    prompt = [1, 2, 3, 4, 5, 6]
    admit(m, 1, prompt)
    m.free(1)
    assert m.pool.free_block_ids() == [3, 2, 1, 0]
    admit(m, 2, [50, 51])  # takes block 3
    longer = [*prompt, 7, 8]
    hit = m.get_computed_blocks(3, longer)
    assert hit.block_ids == (0, 1, 2)
    # Three hit blocks leave the free queue and one fresh block is needed: 4 > 3 free.
    assert m.num_new_blocks_needed(3, 6, 2, hit) == 4
    assert m.can_allocate(3, 8, hit) is AllocStatus.LATER
    assert m.allocate_slots(3, 6, 2, hit) is None
    assert not m.has_table(3)
    assert m.pool.free_block_ids() == [2, 1, 0]
    assert m.prefix_cache_stats().num_queries == 2  # the refused admission is not counted
    m.check_integrity()
    # Room for the hit plus the last token's block once the other sequence is gone.
    m.free(2)
    assert m.can_allocate(3, 8, hit) is AllocStatus.OK
    assert m.allocate_slots(3, 6, 2, hit) == []
    assert m.block_table(3) == [0, 1, 2, 3]
    assert m.num_free_blocks == 0
    assert m.can_allocate(4, 9, NO_HIT) is AllocStatus.NEVER
    m.check_integrity()


def test_hit_on_blocks_in_use_takes_nothing_from_the_free_pool() -> None:
    m = manager(4, 2)
    prompt = [1, 2, 3, 4, 5]
    admit(m, 1, prompt)  # blocks 0, 1 (keyed), 2 (partial)
    hit = m.get_computed_blocks(2, prompt)
    assert hit.block_ids == (0, 1)
    assert m.num_new_blocks_needed(2, 4, 1, hit) == 1
    assert m.can_allocate(2, 5, hit) is AllocStatus.OK
    assert m.allocate_slots(2, 4, 1, hit) == []
    assert m.block_table(2) == [0, 1, 3]
    assert refs(m) == [2, 2, 1, 1]
    m.check_integrity()


def test_fork_copies_only_the_partial_tail_block() -> None:
    m = manager(10, 4)
    prompt = list(range(10))  # blocks 0, 1 full and cached; 2 holds tokens 8, 9
    admit(m, 1, prompt)
    m.fork(1, 2)
    m.fork(1, 3)
    assert refs(m)[:3] == [3, 3, 3]
    m.check_integrity()
    assert m.allocate_slots(2, 10, 1) == [BlockCopy(src=2, dst=3)]
    assert m.allocate_slots(3, 10, 1) == [BlockCopy(src=2, dst=4)]
    assert m.allocate_slots(1, 10, 1) == []
    assert m.block_table(2) == [0, 1, 3] and m.block_table(3) == [0, 1, 4]
    # The children fill their tail blocks with different tokens: both become cached.
    t1, t2, t3 = [*prompt, 7, 7], [*prompt, 8, 8], [*prompt, 7, 7]
    m.allocate_slots(1, 11, 1)
    m.allocate_slots(2, 11, 1)
    m.allocate_slots(3, 11, 1)
    assert m.cache_full_blocks(1, t1, 12) == 1
    assert m.cache_full_blocks(2, t2, 12) == 1
    # Child 3 sampled what the parent did: the key is the parent's block 2; no de-duplication.
    assert m.cache_full_blocks(3, t3, 12) == 0
    assert m.pool.lookup(keys_of(t1, 4)[2]) == 2
    assert m.pool.lookup(keys_of(t2, 4)[2]) == 3
    assert m.pool.blocks[4].key is None
    m.check_integrity()
    # Writing on never copies a cached full block.
    assert m.allocate_slots(2, 12, 3) == []
    assert m.block_table(2) == [0, 1, 3, 5]
    m.check_integrity()
    for s in (1, 2, 3):
        m.free(s)
    m.check_integrity()
    assert m.num_free_blocks == 10


def test_fork_of_a_block_aligned_prompt_copies_nothing() -> None:
    m = manager(8, 4)
    prompt = list(range(8))
    admit(m, 1, prompt)
    m.fork(1, 2)
    assert m.block_keys(2) == keys_of(prompt, 4)
    assert m.allocate_slots(2, 8, 1) == []
    assert m.allocate_slots(1, 8, 1) == []
    assert m.block_table(1) == [0, 1, 3] and m.block_table(2) == [0, 1, 2]
    m.check_integrity()


def test_a_cached_block_in_the_write_range_is_copied_not_overwritten() -> None:
    m = manager(4, 2)
    admit(m, 1, [1, 2, 3])  # block 0 cached, ref 1
    # A caller that rewrites token 1 (e.g. a rolled-back step) must not corrupt the cache.
    assert m.num_new_blocks_needed(1, 1, 1) == 1
    assert m.allocate_slots(1, 1, 1) == [BlockCopy(src=0, dst=2)]
    assert m.block_table(1) == [2, 1]
    assert m.pool.is_free(0) and m.pool.lookup(keys_of([1, 2], 2)[0]) == 0
    m.check_integrity()


def test_cache_full_blocks_is_incremental_and_idempotent() -> None:
    m = manager(8, 4)
    tokens = list(range(11))
    hit = m.get_computed_blocks(1, tokens)
    assert m.allocate_slots(1, 0, 5, hit) == []  # chunked prefill: 5 of 11 tokens
    assert m.cache_full_blocks(1, tokens, 5) == 1
    assert m.cache_full_blocks(1, tokens, 5) == 0
    assert m.allocate_slots(1, 5, 6) == []
    assert m.cache_full_blocks(1, tokens, 11) == 1  # block 2 holds 3 of 4 tokens: not cached
    assert [b.key is not None for b in m.pool.blocks[:3]] == [True, True, False]
    tokens.append(42)  # the sampled token, computed next step, fills block 2
    assert m.allocate_slots(1, 11, 1) == []
    assert m.cache_full_blocks(1, tokens, 12) == 1
    assert m.block_keys(1) == keys_of(tokens, 4)
    m.check_integrity()


def test_protocol_misuse_is_refused() -> None:
    m = manager(8, 4)
    tokens = list(range(9))
    admit(m, 1, tokens, ("a",))
    with pytest.raises(RuntimeError, match="already holds blocks"):
        m.get_computed_blocks(1, tokens, ("a",))
    hit = m.get_computed_blocks(2, tokens, ("a",))
    with pytest.raises(ValueError, match="other extra keys"):
        m.get_computed_blocks(2, tokens, ("b",))
    with pytest.raises(ValueError, match="num_computed"):
        m.allocate_slots(2, 0, 9, hit)
    with pytest.raises(RuntimeError, match="no key chain"):
        m.allocate_slots(3, 0, 4)
        m.cache_full_blocks(3, [1, 2, 3, 4], 4)
    m.free(3)
    m.check_integrity()


def test_a_hit_gone_stale_is_refused() -> None:
    m = manager(3, 2)
    admit(m, 1, [1, 2, 3])  # blocks 0 (cached), 1
    m.free(1)
    hit = m.get_computed_blocks(2, [1, 2, 3])
    assert hit.block_ids == (0,)
    m.allocate_slots(3, 0, 6)  # takes every free block: block 0 is evicted
    with pytest.raises(RuntimeError, match="stale prefix hit"):
        m.allocate_slots(2, 2, 1, hit)
    assert not m.has_table(2)
    m.check_integrity()


def test_promotion_from_a_lower_tier() -> None:
    m = manager(4, 2)
    tokens = [1, 2, 3, 4, 5]
    k0, k1 = keys_of(tokens, 2)
    block_id = m.pool.allocate_for_key(k0)
    assert block_id == 0
    assert m.pool.allocate_for_key(k0) is None  # already being promoted
    assert m.get_computed_blocks(1, tokens).block_ids == ()  # not findable before the data lands
    m.check_integrity()  # the promotion's reference is accounted for
    assert m.pool.publish_promoted(block_id) is True
    assert m.pool.free_block_ids() == [1, 2, 3, 0]  # the tail: evicted last
    failed = m.pool.allocate_for_key(k1)
    assert failed == 1
    m.pool.cancel_promoted(failed)
    assert m.pool.blocks[1].key is None and m.pool.lookup(k1) is None
    m.free(1)
    hit = admit(m, 1, tokens)
    assert hit.block_ids == (0,)
    assert m.pool.allocate_for_key(k0) is None  # cached on the device already
    m.check_integrity()


def test_prefix_caching_off_keeps_the_plain_behaviour() -> None:
    m = KVBlockManager(4, 2)
    tokens = [1, 2, 3, 4, 5]
    assert m.get_computed_blocks(1, tokens) is NO_HIT
    assert m.allocate_slots(1, 0, 5, NO_HIT) == []
    assert m.cache_full_blocks(1, tokens, 5) == 0
    assert all(b.key is None for b in m.pool.blocks)
    m.free(1)
    assert m.get_computed_blocks(2, tokens).block_ids == ()
    assert m.prefix_cache_stats().num_queries == 0
    m.check_integrity()


def test_integrity_detects_cache_corruption() -> None:
    m = manager(6, 2)
    admit(m, 1, [1, 2, 3, 4, 5])  # blocks 0, 1 cached
    admit(m, 2, [7, 8, 9])  # block 3 cached
    m.pool.blocks[1].key, m.pool.blocks[3].key = m.pool.blocks[3].key, m.pool.blocks[1].key
    with pytest.raises(AssertionError, match="index maps it to"):
        m.check_integrity()
    m.pool.blocks[1].key, m.pool.blocks[3].key = m.pool.blocks[3].key, m.pool.blocks[1].key
    m.check_integrity()
    # A free cached block missing from the free queue is caught too.
    m.free(2)
    del m.pool._free[3]
    with pytest.raises(AssertionError, match="block 3: ref_cnt 0, in free queue: False"):
        m.check_integrity()


def test_uncache_free_forgets_free_blocks_only_and_evicts_nothing() -> None:
    m = manager(6, 2)
    evicted: list[int] = []
    m.pool.on_evict = lambda block_id, key, owner: evicted.append(block_id)
    a, b = [1, 2, 3, 4, 5, 6], [11, 12, 13, 14]
    admit(m, 1, a)
    admit(m, 2, b)
    m.free(1)  # a's blocks free and cached; b's in use
    assert m.pool.num_cached_blocks == 5
    order = m.pool.free_block_ids()
    assert m.pool.uncache_free() == 3
    # The same free blocks, only the keys are gone (keyless: handed out lowest id first).
    assert m.pool.free_block_ids() == sorted(order)
    assert m.pool.num_cached_blocks == 2 and all(m.pool.blocks[i].key is None for i in (0, 1, 2))
    m.pool.check_integrity()
    assert admit(m, 3, a).block_ids == ()  # a misses now
    assert evicted == []  # its old blocks were reused without a demotion
    m.free(3)
    assert admit(m, 4, b).block_ids == (3,)  # b's blocks were in use: still cached


def test_purge_owner_forgets_its_free_blocks_and_refuses_its_blocks_later() -> None:
    a, b = b"A" * 32, b"B" * 32
    m = manager(10, 2)
    evicted: list[tuple[int, bytes]] = []
    m.pool.on_evict = lambda block_id, key, owner: evicted.append((block_id, owner))
    p1, p2, p3 = [1, 2, 3, 4, 5], [11, 12, 13, 14, 15], [21, 22, 23, 24, 25]
    for seq_id, tokens, owner in [(1, p1, a), (2, p2, b), (3, p3, a)]:
        hit = m.get_computed_blocks(seq_id, tokens, (b"", owner), owner)
        m.allocate_slots(seq_id, 0, len(tokens), hit)
        m.cache_full_blocks(seq_id, tokens, len(tokens))
    assert [m.pool.blocks[i].owner for i in m.block_table(1)[:2]] == [a, a]
    m.free(1)
    m.free(2)  # 1 and 2 free (cached); 3 still running
    assert m.pool.purge_owner(a) == 2  # sequence 1's two full blocks
    assert m.pool.num_cached_blocks == 4  # b's two and the running a's two
    m.pool.check_integrity()
    assert m.get_computed_blocks(4, p1, (b"", a), a).block_ids == ()
    assert m.get_computed_blocks(5, p2, (b"", b), b).block_ids == (3, 4)
    m.free(3)  # its blocks stay keyed until reused; then on_evict names the owner
    m.pool.allocate(m.pool.num_free_blocks)
    assert sorted(owner for _, owner in evicted) == [a, a, b, b]
    # A purged owner's blocks are never cached again.
    assert not m.pool.cache_block(0, keys_of(p1, 2)[0], a)
    with pytest.raises(ValueError, match="needs an owner"):
        m.pool.purge_owner(b"")


def test_the_owner_is_recorded_once_by_the_lookup_that_starts_the_chain() -> None:
    """Whose blocks a sequence caches comes from its key chain: set by the first lookup, kept
    through later lookups and forks, never changed, and always one of the hashed extra keys."""
    a, b = b"A" * 32, b"B" * 32
    m = manager(12, 2)
    tokens = [1, 2, 3, 4, 5]
    hit = m.get_computed_blocks(1, tokens, (b"", a), a)
    with pytest.raises(ValueError, match="another owner"):
        m.get_computed_blocks(1, tokens, (b"", a), b)  # the same keys, another owner: refused
    assert m.get_computed_blocks(1, tokens, (b"", a), a) == hit  # looking again changes nothing
    m.allocate_slots(1, 0, len(tokens), hit)
    m.cache_full_blocks(1, tokens, len(tokens))
    m.fork(1, 2)
    child = [*tokens, 6, 7, 8]  # the child's own full blocks are its parent's owner's too
    m.allocate_slots(2, len(tokens), 3)
    m.cache_full_blocks(2, child, len(child))
    assert [m.pool.blocks[i].owner for i in m.block_table(2)] == [a, a, a, a]
    with pytest.raises(ValueError, match="one of its extra keys"):
        m.get_computed_blocks(3, tokens, (b"", b""), a)  # an owner its keys do not bind
    assert m.pool.blocks[m.block_table(1)[0]].owner == a
    m.check_integrity()


def test_on_cache_sees_each_block_that_becomes_findable_once() -> None:
    """The pool's ``on_cache`` hook (the tiers drop their copy of the key) runs when a key
    enters the index: computed or promoted, not when refused or cached already."""
    m = manager(8, 2)
    seen: list[BlockKey] = []
    m.pool.on_cache = seen.append
    tokens = [1, 2, 3, 4, 5]
    k0, k1 = keys_of(tokens, 2)
    admit(m, 1, tokens)
    assert seen == [k0, k1]
    m.cache_full_blocks(1, tokens, len(tokens))  # idempotent: nothing new
    admit(m, 2, [9, 9, 9])
    twin = m.pool.allocate(1)[0].block_id
    assert not m.pool.cache_block(twin, k0)  # another block holds k0: stays keyless, no call
    assert m.pool.purge_owner(b"A" * 32) == 0
    assert not m.pool.cache_block(twin, keys_of([7, 7], 2)[0], b"A" * 32)  # a purged owner
    promoted = m.pool.allocate_for_key(keys_of([8, 8], 2)[0])
    assert promoted is not None and m.pool.publish_promoted(promoted)
    assert seen == [k0, k1, keys_of([9, 9, 9], 2)[0], keys_of([8, 8], 2)[0]]
