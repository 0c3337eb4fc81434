"""The sliding-window block manager: a sequence far past its window holds only the blocks its
window reads, the freed blocks serve other sequences, and prefix hits, forks and the prefix
cache's keys stay correct with PAD entries in the tables.

Window convention (HF's): a query at position ``p`` reads keys ``p - W < k <= p``.
"""

from __future__ import annotations

from loraplex.kernels.metadata import PAD_BLOCK_ID
from loraplex.storage.kv.block_manager import AllocStatus, KVBlockManager


def _decode(m: KVBlockManager, seq_id: int, start: int, end: int) -> None:
    """Decode tokens ``start .. end - 1`` one step each, as the scheduler does (allocate, run,
    cache the full blocks, free what left the window)."""
    for p in range(start, end):
        assert m.allocate_slots(seq_id, p, 1) is not None, f"no block for position {p}"
        m.cache_full_blocks(seq_id, list(range(p + 1)), p + 1)
        m.free_outside_window(seq_id, p + 1)


def test_sequence_far_past_the_window_holds_only_its_window_blocks() -> None:
    # W = 32 tokens, blocks of 16: a decode step reads at most ceil((32 + 15) / 16) = 3 blocks.
    m = KVBlockManager(num_blocks=12, block_size=16, sliding_window=32)
    assert m.window_step_blocks == 3
    # 1,000 tokens are 63 blocks: never for a 12-block pool without a window. With one, not
    # in one chunk (later), but in chunks the pool holds (the scheduler cuts them so).
    assert KVBlockManager(num_blocks=12, block_size=16).can_allocate(0, 1000) is AllocStatus.NEVER
    assert m.can_allocate(0, 1000) is AllocStatus.LATER
    assert m.can_allocate(0, m.max_chunk_tokens() or 0) is AllocStatus.OK

    assert m.allocate_slots(0, 0, 40) == []  # a 40-token prompt: blocks 0..2
    m.free_outside_window(0, 40)  # the next query (40) reads keys 9..40: blocks 0..2, none freed
    assert m.num_held_blocks(0) == 3
    most = 0
    for p in range(40, 1000):
        _decode(m, 0, p, p + 1)
        most = max(most, m.num_held_blocks(0))
        m.check_integrity()
    assert most == 3
    table = m.block_table(0)
    # 1,000 tokens computed: 63 entries; the next query (1000) reads keys 969..1000, i.e.
    # blocks 60..62. Entries 0..59 are PAD and their blocks are back in the pool.
    assert len(table) == 63
    assert table[:60] == [PAD_BLOCK_ID] * 60 and PAD_BLOCK_ID not in table[60:]
    assert m.num_held_blocks(0) == 3 and m.num_free_blocks == 9
    assert m.num_window_freed_blocks == 60
    try:
        m.slot(0, 100)
        raise AssertionError("a freed position has no slot")
    except ValueError as exc:
        assert "sliding window" in str(exc)

    # The freed blocks serve another request: 144 tokens take the other 9 blocks.
    assert m.can_allocate(1, 144) is AllocStatus.OK
    assert m.allocate_slots(1, 0, 144) == []
    assert m.num_free_blocks == 0
    # And the long sequence keeps decoding in the full pool: each new block it needs comes
    # from one its window just left (block 60 goes when the query reaches 1007).
    _decode(m, 0, 1000, 1100)
    assert m.num_held_blocks(0) <= 3 and m.num_free_blocks + m.num_held_blocks(0) == 3
    m.check_integrity()
    m.free(0)
    m.free(1)
    m.check_integrity()
    assert m.num_free_blocks == 12


def test_admission_and_chunks_with_a_window() -> None:
    m = KVBlockManager(num_blocks=8, block_size=4, sliding_window=8)
    # A decode step reads ceil((8 + 3) / 4) = 3 blocks; the longest chunk that fits the pool
    # with the window before it is 8 * 4 - 8 - 4 + 2 = 22 tokens.
    assert (m.window_step_blocks, m.max_chunk_tokens()) == (3, 22)
    assert KVBlockManager(num_blocks=8, block_size=4).max_chunk_tokens() is None
    assert (
        KVBlockManager(num_blocks=2, block_size=4, sliding_window=8).can_allocate(0, 9) is AllocStatus.NEVER
    )
    # Chunks of 22 over a 60-token prompt (15 blocks, twice the pool) always fit.
    for start in (0, 22, 44):
        num_new = min(22, 60 - start)
        needed = m.num_new_blocks_needed(0, start, num_new)
        free = m.num_free_blocks
        assert m.allocate_slots(0, start, num_new) is not None
        assert m.num_free_blocks == free - needed  # the accounting counts what the window frees
        m.free_outside_window(0, start + num_new)
    # The next query (60) reads 53..60: blocks 13, 14 (15 entries, 13 PAD).
    assert m.num_held_blocks(0) == 2 and len(m.block_table(0)) == 15
    m.check_integrity()


def test_fork_siblings_free_shared_blocks_only_when_both_left_them() -> None:
    m = KVBlockManager(num_blocks=16, block_size=4, sliding_window=8)
    _decode(m, 0, 0, 20)
    m.fork(0, 1)
    shared = [b for b in m.block_table(0) if b != PAD_BLOCK_ID]
    assert all(m.pool.blocks[b].ref_cnt == 2 for b in shared)
    _decode(m, 0, 20, 40)  # the parent moves on; the child stays at 20
    # The parent dropped its reference to the shared blocks; the child still reads them.
    assert all(m.pool.blocks[b].ref_cnt == 1 for b in shared)
    assert m.block_table(1)[-len(shared) :] == shared
    m.check_integrity()
    assert m.num_free_blocks == 16 - m.num_held_blocks(0) - len(shared)
    _decode(m, 1, 20, 40)  # now the child leaves them too: back in the pool (and reused)
    m.check_integrity()
    assert m.num_held_blocks(0) == m.num_held_blocks(1) == 2  # query 40 reads blocks 8, 9
    assert m.num_free_blocks == 16 - 4


def test_prefix_hit_takes_only_the_window_and_pads_the_rest() -> None:
    """The rule: a hit of ``n`` blocks is used only where every block the next query (at
    ``n * block_size``) reads is resident; of it only those blocks are taken, the entries before
    are PAD, whether their blocks are still cached or gone. Blocks freed out of a window keep
    their key and KV until the pool reuses them, when the key goes too: no key points at
    missing KV."""
    m = KVBlockManager(num_blocks=20, block_size=4, enable_prefix_caching=True, sliding_window=8)
    prompt = list(range(100, 140))  # 40 tokens: 10 full blocks
    hit = m.get_computed_blocks(0, prompt)
    assert hit.num_cached_blocks == 0
    assert m.allocate_slots(0, 0, 40, hit) == []
    m.cache_full_blocks(0, prompt, 40)
    # Query 40 reads 33..40: blocks 8, 9 stay; 0..7 go back to the pool, still cached.
    assert m.free_outside_window(0, 40) == 8
    assert m.num_free_blocks == 18 and m.prefix_cache_stats().num_cached_blocks == 10

    other = [*prompt, 7]
    hit = m.get_computed_blocks(1, other)
    assert hit.num_cached_blocks == 10
    assert hit.block_ids[:8] == (PAD_BLOCK_ID,) * 8  # query 40 never reads them
    assert m.can_allocate(1, 41, hit) is AllocStatus.OK
    assert m.num_new_blocks_needed(1, 40, 1, hit) == 1  # blocks 8, 9 are shared, one fresh
    assert m.allocate_slots(1, 40, 1, hit) == []
    table = m.block_table(1)
    assert table[:8] == [PAD_BLOCK_ID] * 8 and table[8:10] == m.block_table(0)[8:10]
    assert m.num_held_blocks(1) == 3 and m.num_free_blocks == 17
    m.check_integrity()

    # Fill the pool: the freed cached blocks are evicted (oldest freed first) and their keys
    # leave the index. The window's blocks (8, 9: sequence 0 holds them) still give a full hit.
    m.free(1)
    keys = m.block_keys(0)
    assert m.allocate_slots(2, 0, 4 * m.num_free_blocks) == []
    assert m.num_free_blocks == 0
    assert all(m.pool.lookup(key) is None for key in keys[:8])
    hit = m.get_computed_blocks(3, other)
    assert hit.num_cached_blocks == 10 and hit.block_ids[8:] == tuple(m.block_table(0)[8:10])
    m.free(3)
    # A shorter prompt whose window lies in the evicted blocks: block 4 is gone, so the longest
    # hit whose window (query 20 reads 13..20: blocks 3, 4) is resident is none at all.
    hit = m.get_computed_blocks(4, prompt[:21])
    assert hit.num_cached_blocks == 0
    m.check_integrity()
