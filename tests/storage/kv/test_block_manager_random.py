"""Random admissions, chunked prefills, decodes, forks, preemptions, frees and promotions
against a model of what each KV slot holds; integrity and content checked after every op.

A slot written for token ``p`` of a sequence holds ``(extra_keys, tokens[:p + 1])``:
exactly what that token's K and V depend on. So any hit on a wrong block, a write into
a shared or cached block, a lost copy-on-write or a promotion published from a failed
transfer shows up as a slot whose content differs from what its sequence expects.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from loraplex.storage.kv.block_hash import BlockKey, ExtraKeys, block_keys
from loraplex.storage.kv.block_manager import AllocStatus, BlockCopy, KVBlockManager
from loraplex.storage.kv.prefix_cache import NO_HIT, PrefixHit

Slot = tuple[ExtraKeys, tuple[int, ...]] | None
GARBAGE: Slot = ((), (-1,))


@dataclass
class Seq:
    tokens: list[int]
    extra: ExtraKeys
    num_computed: int = 0


@dataclass
class Sim:
    m: KVBlockManager
    rng: random.Random
    content: list[list[Slot]]
    seqs: dict[int, Seq] = field(default_factory=dict)  # hold a table
    waiting: dict[int, Seq] = field(default_factory=dict)  # preempted or not yet admitted
    lower: dict[BlockKey, list[Slot]] = field(default_factory=dict)  # a lower tier, fed by on_evict
    next_id: int = 0

    def run(self, copies: list[BlockCopy], seq_id: int, start: int, end: int) -> None:
        """The runner: block copies, then the forward writes tokens start..end-1."""
        for c in copies:
            self.content[c.dst] = list(self.content[c.src])
        seq, bs = self.seqs[seq_id], self.m.block_size
        table = self.m.block_table(seq_id)
        for p in range(start, end):
            self.content[table[p // bs]][p % bs] = (seq.extra, tuple(seq.tokens[: p + 1]))
        seq.num_computed = end
        self.m.cache_full_blocks(seq_id, seq.tokens, end)
        # The scheduler frees what left the window after each step; skipped half the time
        # here, so that allocate_slots (and its accounting) does it instead.
        if self.rng.random() < 0.5:
            self.m.free_outside_window(seq_id, end)

    def schedule(self, seq_id: int, seq: Seq, hit: PrefixHit) -> bool:
        """allocate_slots for one chunk; check the accounting is exact. False = no room."""
        start = hit.num_cached_tokens if hit.block_ids else seq.num_computed
        num_new = min(len(seq.tokens) - start, self.rng.randint(1, 7))
        needed = self.m.num_new_blocks_needed(seq_id, start, num_new, hit)
        free_before = self.m.num_free_blocks
        if hit is not NO_HIT:
            status = self.m.can_allocate(seq_id, start + num_new, hit)
            assert (status is AllocStatus.OK) == (needed <= free_before)
        copies = self.m.allocate_slots(seq_id, start, num_new, hit)
        if copies is None:
            assert needed > free_before
            return False
        assert self.m.num_free_blocks == free_before - needed
        self.seqs[seq_id] = seq
        self.run(copies, seq_id, start, start + num_new)
        return True

    def admit(self) -> None:
        if self.waiting and self.rng.random() < 0.5:
            seq_id = self.rng.choice(list(self.waiting))
            seq = self.waiting.pop(seq_id)
        else:
            seq_id, self.next_id = self.next_id, self.next_id + 1
            prefix = self.rng.choice([[], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 9], [5] * 11])
            tail = [self.rng.randint(0, 3) for _ in range(self.rng.randint(1, 6))]
            seq = Seq([*prefix, *tail], self.rng.choice([(), ("ad1", "t1"), ("ad1", "t2"), ("ad1t", "2")]))
        seq.num_computed = 0
        self.promote(seq)
        hit = self.m.get_computed_blocks(seq_id, seq.tokens, seq.extra)
        if not self.schedule(seq_id, seq, hit):
            self.m.free(seq_id)  # drops the key chain of a sequence that stays waiting
            self.waiting[seq_id] = seq

    def promote(self, seq: Seq) -> None:
        """Bring blocks of ``seq``'s prompt back from the lower tier; some transfers fail."""
        for key in block_keys(seq.tokens, self.m.block_size, self.m.prefix_cache.root, seq.extra):
            data = self.lower.get(key)
            if data is None or self.m.pool.lookup(key) is not None:
                continue
            block_id = self.m.pool.allocate_for_key(key)
            if block_id is None:
                return
            if self.rng.random() < 0.25:
                self.content[block_id] = [GARBAGE] * self.m.block_size  # a torn transfer
                self.m.pool.cancel_promoted(block_id)
            else:
                self.content[block_id] = list(data)
                self.m.pool.publish_promoted(block_id)

    def step(self) -> None:
        seq_id = self.rng.choice(list(self.seqs))
        seq = self.seqs[seq_id]
        if seq.num_computed == len(seq.tokens):
            seq.tokens.append(self.rng.randint(0, 3))  # sampled; computed by this step
        if not self.schedule(seq_id, seq, NO_HIT):
            self.preempt(seq_id)

    def preempt(self, seq_id: int) -> None:
        self.m.free(seq_id)
        self.waiting[seq_id] = self.seqs.pop(seq_id)

    def fork(self) -> None:
        parent_id = self.rng.choice(list(self.seqs))
        parent = self.seqs[parent_id]
        child_id, self.next_id = self.next_id, self.next_id + 1
        self.m.fork(parent_id, child_id)
        self.seqs[child_id] = Seq(list(parent.tokens), parent.extra, parent.num_computed)

    def finish(self) -> None:
        seq_id = self.rng.choice(list(self.seqs))
        self.m.free(seq_id)
        del self.seqs[seq_id]

    def check(self) -> None:
        self.m.check_integrity()
        bs = self.m.block_size
        for seq_id, seq in self.seqs.items():
            table = self.m.block_table(seq_id)
            # With a sliding window only what the next query reads must still be there.
            start = self.m.first_kept_block(seq.num_computed) * bs
            # Freed entries lie only behind the window (freeing itself may wait for allocate_slots).
            assert len(table) - start // bs <= self.m.num_held_blocks(seq_id) <= len(table)
            for p in range(start, seq.num_computed):
                got = self.content[table[p // bs]][p % bs]
                assert got == (seq.extra, tuple(seq.tokens[: p + 1])), (seq_id, p, table)
        for block in self.m.pool.blocks:
            if block.key is not None:
                assert GARBAGE not in self.content[block.block_id], block


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 1, 5, 9])
@pytest.mark.parametrize("seed", range(12))
def test_random_ops_keep_integrity_and_content(seed: int, window: int | None) -> None:
    """``window``: a sliding window, whose blocks behind it are freed as sequences grow."""
    rng = random.Random(seed)
    num_blocks, block_size = rng.choice([(6, 2), (10, 2), (12, 4), (24, 3)])
    m = KVBlockManager(
        num_blocks, block_size, enable_prefix_caching=True, fingerprint=b"sim", sliding_window=window
    )
    sim = Sim(m, rng, [[None] * block_size for _ in range(num_blocks)])

    def demote(block_id: int, key: BlockKey, owner: bytes) -> None:
        # Runs before the block is handed out: its content is still the cached one.
        assert GARBAGE not in sim.content[block_id]
        sim.lower[key] = list(sim.content[block_id])

    m.pool.on_evict = demote
    for _ in range(400):
        op = rng.random()
        if op < 0.3 or not sim.seqs:
            sim.admit()
        elif op < 0.75:
            sim.step()
        elif op < 0.82:
            sim.fork()
        elif op < 0.9:
            sim.preempt(rng.choice(list(sim.seqs)))
        else:
            sim.finish()
        sim.check()
    for seq_id in list(sim.seqs):
        m.free(seq_id)
    m.check_integrity()
    assert m.num_free_blocks == num_blocks
    stats = m.prefix_cache_stats()
    assert stats.num_queries > 0 and stats.num_hit_blocks > 0 and stats.num_evicted_blocks > 0
    assert (m.num_window_freed_blocks > 0) == (window is not None)
