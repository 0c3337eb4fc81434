"""The physical KV block pool: ids, reference counts, the LRU free queue and the key index.

The pool knows nothing about sequences; the block manager maps sequences to
blocks. A full block may carry a content key (``block_hash``); the pool keeps an
index ``key -> block_id`` of those cached blocks. A freed block keeps its key and
stays findable in the free queue until it is handed out again, so the free queue
doubles as the prefix cache's LRU eviction order (vLLM v1):

    allocate(n)            take free blocks: keyless ones first, lowest id first; then
                           the oldest freed keyed blocks, which are *evicted*: the key
                           leaves the index and ``on_evict(block_id, key, owner)`` runs
                           before the block is handed out (demotion hook)
    lookup(key)            the cached block for ``key`` or None (no state change)
    take(block_id)         a hit: ref 0 -> 1 leaves the free queue, else ref += 1
    cache_block(id, key, owner)  register a full block under ``key`` (first one wins);
                           ``on_cache(key)`` then runs (the tiers drop their copies of ``key``)
    decref(block_id)       at ref 0 the block joins the free queue's tail, key kept
    uncache_free()         forget every free block's key (a prefix-cache reset)
    purge_owner(owner)     forget the free blocks ``owner`` owns; never cache its blocks again

Keyless blocks go lowest id first so the pool's top stays free for as long as there is
room elsewhere: the adapter page arena (``kv_arena``) borrows blocks from the top, one
pool for KV and adapter weights (S-LoRA's unified paging):

    lendable()            how many free blocks lie just below the lent ones (not promoting)
    lend(n)               the n blocks below ``limit`` leave the pool (keyed ones are
                          evicted first, through ``on_evict``); ``limit`` drops by n
    unlend(n)             the n lowest lent blocks come back, keyless and free

``owner`` is the tenant's cache salt (b"": nobody's): the tiers keep it with the block, so a
deleted tenant's blocks can be found and purged on every tier.

With ``events`` set (``kv_events``), a key leaving the index is a ``BlocksRemoved`` (GPU): an
eviction, a purge (a reset is one ``AllCleared``, emitted by ``TieredKV``), and a published
promotion a ``BlocksStored``; blocks the prefix cache registers are reported there, with tokens.

Promotion from a lower tier (host, disk) into a fresh block, paired verbs:

    allocate_for_key(key)      a fresh block (ref 1, held by the promotion, not findable)
    publish_promoted(block_id) the data landed: index it under key, drop the promotion's ref
    cancel_promoted(block_id)  the transfer failed: drop the ref, the block stays keyless

A block is findable only after its data is there, so a failed transfer is a miss,
never a hit on garbage.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from loraplex.storage.kv.block_hash import BlockKey
from loraplex.storage.kv.kv_events import GPU, BlocksStored, KVEventLog

CacheCallback = Callable[[BlockKey], None]
"""``on_cache(key)``: a block just became findable under ``key`` (computed here, or promoted).

Whatever a lower tier still holds under ``key`` is now a second copy (the device computed
it again, e.g. after a failed read); the hook lets the tiers drop it, so every cached block
keeps one location. Runs after the index holds the block; it must not raise.
"""

EvictCallback = Callable[[int, BlockKey, bytes], None]
"""``on_evict(block_id, key, owner)``: a cached block is about to be reused; copy its data out now.

Runs before the block is handed out, so its KV is still intact; the copy (or a
transfer enqueued by it) must complete before the next forward writes the block.
It must not raise: the pool has already dropped the key from its index.
"""


class CachedBlock(NamedTuple):
    """A findable block: where it is, its key and whose it is (b"": nobody's)."""

    block_id: int
    key: BlockKey
    owner: bytes


@dataclass
class KVBlock:
    """One physical block: ``block_size`` token slots in every layer's K and V cache.

    ``key`` is set only while the block is full, indexed, and therefore immutable.
    """

    block_id: int
    ref_cnt: int = 0
    key: BlockKey | None = None
    owner: bytes = b""  # whose cached block (with ``key``)


class BlockPool:
    """Hands out blocks and takes them back; ``ref_cnt == 0`` blocks are free."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # OrderedDict as an O(1) LRU queue: popitem(last=False) takes the oldest
        # and pop() removes from the middle (a prefix-cache hit on a free block).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Keyless free blocks, lowest first (lazy: an id here may have been taken since;
        # ``_pop_keyless`` skips those). Every keyless free block is in it.
        self._keyless: list[int] = list(range(num_blocks))
        self.limit = num_blocks  # blocks [limit, num_blocks) are lent to the adapter arena
        # Blocks that left the free queue, highest first (lazy: ``lendable`` drops the entries
        # of blocks free again), so the free run at the top is found without a scan.
        self._taken: list[int] = []
        self._index: dict[BlockKey, int] = {}
        self._promoting: dict[int, tuple[BlockKey, bytes]] = {}  # block -> (key, owner)
        self._purged: set[bytes] = set()  # owners whose blocks are never cached again
        self.on_evict: EvictCallback | None = None
        self.on_cache: CacheCallback | None = None
        self.events: KVEventLog | None = None
        """Where keys leaving the index (and promoted ones arriving) are reported; None: nowhere."""
        self.num_evicted_blocks = 0

    # -- queries ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by key (in use or free)."""
        return len(self._index)

    def free_block_ids(self) -> list[int]:
        """Free block ids in the order they would be handed out."""
        keyless = sorted(b for b in self._free if self.blocks[b].key is None)
        return keyless + [b for b in self._free if self.blocks[b].key is not None]

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def lookup(self, key: BlockKey) -> int | None:
        """The block cached under ``key``, or None. Changes nothing (no LRU touch)."""
        return self._index.get(key)

    def promoting_block_ids(self) -> list[int]:
        """Blocks held by a promotion in flight (one reference each)."""
        return list(self._promoting)

    # -- allocation ------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` free blocks, each with ref_cnt 1: keyless ones lowest id first,
        then cached ones, oldest freed first.

        A block that still holds a cached key is evicted on the way out: its key
        leaves the index and ``on_evict`` sees it before the caller gets the block.
        """
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks with only {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            block_id = self._pop_keyless()
            if block_id is None:  # only cached blocks are free: evict the least recently used
                block_id, _ = self._free.popitem(last=False)
            else:
                del self._free[block_id]
            self._note_taken(block_id)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0, f"free block {block_id} has ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
            if block.key is not None:
                self._evict(block)
            out.append(block)
        return out

    def _pop_keyless(self) -> int | None:
        while self._keyless:
            block_id = heapq.heappop(self._keyless)
            if block_id in self._free and self.blocks[block_id].key is None:
                return block_id
        return None

    def _push_keyless(self, block_id: int) -> None:
        heapq.heappush(self._keyless, block_id)
        if len(self._keyless) > 2 * self.num_blocks:  # stale entries (blocks taken since): rebuild
            self._keyless = sorted(b for b in self._free if self.blocks[b].key is None)

    def _evict(self, block: KVBlock) -> None:
        key = block.key
        assert key is not None, f"block {block.block_id} has no key to evict"
        assert self._index.get(key) == block.block_id, (
            f"block {block.block_id} has key {key.hex()} but the index maps it to {self._index.get(key)}"
        )
        del self._index[key]
        owner, block.key, block.owner = block.owner, None, b""
        self.num_evicted_blocks += 1
        if self.events is not None:
            self.events.removed((key,), GPU)
        if self.on_evict is not None:
            self.on_evict(block.block_id, key, owner)

    def take(self, block_id: int) -> None:
        """A prefix-cache hit: one more reference to a cached block (free or in use)."""
        block = self.blocks[block_id]
        if block.key is None:
            raise RuntimeError(f"block {block_id} holds no cached key: not a prefix-cache hit")
        if block.ref_cnt == 0:
            del self._free[block_id]
            self._note_taken(block_id)
        block.ref_cnt += 1

    def incref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_cnt > 0, f"incref on free block {block_id}"
        block.ref_cnt += 1

    def decref(self, block_id: int) -> None:
        """Drop one reference; at zero the block joins the tail of the free queue, key kept."""
        block = self.blocks[block_id]
        assert block.ref_cnt > 0, f"decref on free block {block_id}"
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self._free[block_id] = None
            if block.key is None:
                self._push_keyless(block_id)

    def decref_all(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self.decref(block_id)

    # -- the key index ---------------------------------------------------------
    def cache_block(self, block_id: int, key: BlockKey, owner: bytes = b"") -> bool:
        """Make a full, written block findable under ``key`` (``owner``'s); True if it now is.

        False for an owner ``purge_owner`` purged: a deleted tenant's requests still running
        compute blocks that no one can hit and that must not go down the tiers.

        If another block already holds ``key`` the index keeps that one and this
        block stays keyless: blocks are never de-duplicated, because a block table
        must stay append-only (the runner and other tables already point at both).
        """
        block = self.blocks[block_id]
        if block.key is not None:
            if block.key != key:
                raise RuntimeError(f"block {block_id} is cached as {block.key.hex()}, not {key.hex()}")
            return True
        if key in self._index or (owner and owner in self._purged):
            return False
        block.key, block.owner = key, owner
        self._index[key] = block_id
        if self.on_cache is not None:
            self.on_cache(key)
        return True

    def uncache_free(self) -> int:
        """Forget the key of every free cached block (``reset_prefix_cache``); how many.

        The blocks stay free, in the same queue order, and are reused without an eviction
        (nothing is demoted). Blocks in use keep their keys: a running sequence's table
        points at them, and they are findable again only as long as they stay cached.
        """
        return self._uncache([b for b in self._free if self.blocks[b].key is not None])

    def purge_owner(self, owner: bytes) -> int:
        """Forget the keys of ``owner``'s free blocks and refuse its blocks from now on; how many.

        Its blocks in use keep their keys until freed and reused (then ``on_evict`` sees the
        owner, so the tiers can drop them instead of storing them).
        """
        if not owner:
            raise ValueError("purge_owner needs an owner: blocks of nobody are reset, not purged")
        self._purged.add(owner)
        doomed = [b for b in self._free if self.blocks[b].key is not None and self.blocks[b].owner == owner]
        if self.events is not None:
            self.events.removed([k for b in doomed if (k := self.blocks[b].key) is not None], GPU)
        return self._uncache(doomed)

    def is_purged(self, owner: bytes) -> bool:
        return bool(owner) and owner in self._purged

    def _uncache(self, block_ids: list[int]) -> int:
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.key is not None
            del self._index[block.key]
            block.key, block.owner = None, b""
            self._push_keyless(block_id)
        return len(block_ids)

    def cached_blocks(self) -> list[CachedBlock]:
        """Every findable block, its key and owner; least recently used first among the free ones."""
        free = [self.blocks[b] for b in self._free if self.blocks[b].key is not None]
        used = [self.blocks[b] for b in self._index.values() if self.blocks[b].ref_cnt > 0]
        return [CachedBlock(b.block_id, k, b.owner) for b in free + used if (k := b.key) is not None]

    def cached_keys(self) -> set[BlockKey]:
        """The keys findable now (blocks in use or free); what the tiers must not hold too."""
        return set(self._index)

    # -- lending the top of the pool (the adapter arena) ---------------------------
    @property
    def num_lent(self) -> int:
        return self.num_blocks - self.limit

    def _note_taken(self, block_id: int) -> None:
        heapq.heappush(self._taken, -block_id)
        if len(self._taken) > 4 * self.num_blocks:  # stale entries: rebuild
            self._taken = [-b for b in range(self.limit) if b not in self._free]
            heapq.heapify(self._taken)

    def lendable(self) -> int:
        """Free blocks just below ``limit``, in a row: what ``lend`` could take now."""
        while self._taken:
            block_id = -self._taken[0]
            if block_id < self.limit and block_id not in self._free:
                return self.limit - 1 - block_id
            heapq.heappop(self._taken)  # free again (or lent): the next one down decides
        return self.limit

    def lend(self, num_blocks: int) -> None:
        """Take the ``num_blocks`` blocks below ``limit`` out of the pool (they must be free).

        A cached one is evicted first (``on_evict`` copies it down a tier), so the arena
        may write the memory as soon as this returns.
        """
        start = self.limit - num_blocks
        if num_blocks < 0 or start < 0 or any(b not in self._free for b in range(start, self.limit)):
            raise RuntimeError(f"cannot lend {num_blocks} blocks below {self.limit}: not all free")
        for block_id in range(start, self.limit):
            del self._free[block_id]
            block = self.blocks[block_id]
            if block.key is not None:
                self._evict(block)
        self.limit = start

    def unlend(self, num_blocks: int) -> None:
        """Give the ``num_blocks`` lowest lent blocks back to the pool, free and keyless."""
        if not 0 <= num_blocks <= self.num_lent:
            raise RuntimeError(f"cannot return {num_blocks} blocks: {self.num_lent} are lent")
        for block_id in range(self.limit, self.limit + num_blocks):
            self._free[block_id] = None
            self._push_keyless(block_id)
        self.limit += num_blocks

    # -- promotion from a lower tier -------------------------------------------

    def allocate_for_key(self, key: BlockKey, owner: bytes = b"") -> int | None:
        """A fresh block to copy ``key``'s data into, or None (already cached here, or no free block).

        The block has ref_cnt 1, held by the promotion, and is not findable until
        ``publish_promoted``; exactly one of ``publish_promoted`` / ``cancel_promoted``
        must follow.
        """
        if key in self._index or any(k == key for k, _ in self._promoting.values()) or not self._free:
            return None
        (block,) = self.allocate(1)
        self._promoting[block.block_id] = (key, owner)
        return block.block_id

    def publish_promoted(self, block_id: int) -> bool:
        """The promoted data is in ``block_id``: index it and release the promotion's reference.

        The block then sits at the free queue's tail (most recently used) unless a
        sequence already took it. Returns False if the key was cached by another
        block meanwhile (this one is then released keyless).
        """
        key, owner = self._promoting.pop(block_id)
        published = self.cache_block(block_id, key, owner)
        if published and self.events is not None:
            # The promotion knows the key, not the tokens: the router learnt those when the
            # block was first computed (vLLM's offloading loads are reported the same way).
            self.events.emit(BlocksStored((key,), None, (), GPU, owner))
        self.decref(block_id)
        return published

    def cancel_promoted(self, block_id: int) -> None:
        """The transfer into ``block_id`` failed: release it without a key (a miss)."""
        self._promoting.pop(block_id)
        self.decref(block_id)

    # -- invariants ------------------------------------------------------------
    def check_integrity(self) -> None:
        """Free blocks are ref 0 and queued once; the index and block keys agree; lent blocks
        are neither free nor in use; free + in use + lent = the pool."""
        for block in self.blocks[self.limit :]:
            if block.ref_cnt != 0 or block.key is not None or block.block_id in self._free:
                raise AssertionError(
                    f"lent block {block.block_id}: ref_cnt {block.ref_cnt}, key {block.key!r}, "
                    f"free: {block.block_id in self._free}"
                )
        for block in self.blocks[: self.limit]:
            queued = block.block_id in self._free
            if block.ref_cnt < 0 or queued != (block.ref_cnt == 0):
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, in free queue: {queued}"
                )
            if block.key is not None and self._index.get(block.key) != block.block_id:
                raise AssertionError(
                    f"block {block.block_id} has key {block.key.hex()} but the index maps it to "
                    f"{self._index.get(block.key)}"
                )
        for key, block_id in self._index.items():
            if self.blocks[block_id].key != key:
                raise AssertionError(f"index maps {key.hex()} to block {block_id}, whose key differs")
        for block_id in self._promoting:
            block = self.blocks[block_id]
            if block.ref_cnt < 1 or block.key is not None:
                raise AssertionError(
                    f"promoting block {block_id}: ref_cnt {block.ref_cnt}, key {block.key!r}"
                )
