"""Maps sequences to KV blocks: prefix-cache lookup, allocate, append slots, fork (copy-on-write), free.

A sequence's block table is the list of physical block ids holding its tokens in
order; token ``p`` lives in block ``table[p // block_size]`` at offset
``p % block_size``. Blocks are shared between sequences after ``fork`` (parallel
sampling) and after prefix-cache hits, and carry a reference count; the first write
into a shared block copies it first (copy-on-write), so siblings never see each
other's tokens.

Protocol, per step (paired verbs in the nano-vllm style):

    get_computed_blocks(seq_id, tokens, extra_keys) -> PrefixHit  (lookup, no refs taken)
    can_allocate(seq_id, num_tokens, hit)  -> OK | LATER | NEVER   (admission answer)
    allocate_slots(seq_id, num_computed, num_new, hit) -> copies | None (None = no room)
    cache_full_blocks(seq_id, tokens, num_computed)   blocks computed full become findable
    fork(parent_id, child_id)          share every block, ref_cnt += 1
    free(seq_id)                       drop the table; blocks return at ref_cnt 0, keys kept

With prefix caching on, a full block that has been computed gets a content key
(``block_hash``) and is never written again: writes only go to a sequence's
partial last block, so copy-on-write only ever copies that tail block (a keyed
block in the write range would be copied too, never overwritten). A freed keyed
block stays findable in the pool's LRU free queue until it is reused; tiers see
that moment through ``pool.on_evict`` and promote blocks back through
``pool.allocate_for_key`` / ``publish_promoted`` (see ``block_pool``).

Sliding window (``sliding_window`` = W, every layer's): blocks before a sequence's window go
back to the pool and leave ``PAD_BLOCK_ID`` in their table entries, and admission counts only
the entries a step keeps (``block_window``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

import torch

from loraplex.kernels.metadata import PAD_BLOCK_ID
from loraplex.storage.kv.block_hash import BlockKey, ExtraKeys
from loraplex.storage.kv.block_pool import BlockPool, KVBlock
from loraplex.storage.kv.block_window import BlockWindow
from loraplex.storage.kv.kv_events import NO_ORIGIN, BlockOrigin
from loraplex.storage.kv.prefix_cache import NO_HIT, PrefixCache, PrefixCacheStats, PrefixHit


class AllocStatus(enum.Enum):
    """Admission answer for a new or resumed sequence."""

    OK = "ok"  # enough free blocks now
    LATER = "later"  # fits the pool, but not with what is in use now
    NEVER = "never"  # larger than the whole pool: would never fit


class BlockCopy(NamedTuple):
    """A copy-on-write the model runner must do before the forward: src -> dst."""

    src: int
    dst: int


class KVBlockManager:
    """Owns the block tables of all live sequences on top of a ``BlockPool``.

    ``fingerprint`` names the model and KV layout (the engine passes a digest of the
    model, its config, the KV dtype and block size); it roots every block key, so a
    cache written under another model or layout never hits.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        fingerprint: bytes = b"",
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.window = BlockWindow(sliding_window, block_size)
        self.pool = BlockPool(num_blocks)
        self._tables: dict[int, list[int]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache = PrefixCache(self.pool, block_size, fingerprint)

    # -- queries ---------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        """``seq_id``'s table; entries freed out of the sliding window hold ``PAD_BLOCK_ID``."""
        return self._tables.get(seq_id, [])

    def num_held_blocks(self, seq_id: int) -> int:
        """Blocks ``seq_id``'s table holds (its PAD entries, freed out of the window, aside)."""
        return len(self._tables.get(seq_id, ())) - self.window.num_padded(seq_id)

    # -- sliding window (``block_window``) ---------------------------------------
    @property
    def sliding_window(self) -> int | None:
        """Every layer's window (None: some layer attends to the whole context; nothing is freed)."""
        return self.window.size

    def first_kept_block(self, position: int) -> int:
        """The first table entry a query at ``position`` (or any later one) reads; 0 without a
        window. Entries before it may be freed."""
        return self.window.first_kept_block(position)

    @property
    def window_step_blocks(self) -> int | None:
        """The most blocks a windowed sequence holds at a decode step, at any context length
        (None without a window)."""
        return self.window.step_blocks

    @property
    def num_window_freed_blocks(self) -> int:
        """Blocks freed out of the window since start-up."""
        return self.window.num_freed_blocks

    def max_chunk_tokens(self) -> int | None:
        """The longest prefill chunk whose blocks (the window before it included) fit the whole
        pool: the scheduler caps chunks at this, so a windowed sequence longer than the pool
        still runs. None without a window (then a sequence must fit the pool whole)."""
        return self.window.max_chunk_tokens(self.pool.num_blocks)

    def free_outside_window(self, seq_id: int, next_position: int) -> int:
        """Return to the pool the blocks of ``seq_id`` that no query at ``next_position`` or
        later reads (its next new token's position: its ``num_computed_tokens``), leaving
        ``PAD_BLOCK_ID`` in their entries; return how many were freed.

        A shared block (a fork's sibling, another sequence's prefix hit) only loses this
        table's reference. Cached blocks keep their key until the pool reuses them.
        Idempotent; a no-op without a window.
        """
        return self.window.free_outside(seq_id, self._tables.get(seq_id, []), next_position, self.pool)

    def has_table(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def seq_ids(self) -> list[int]:
        """Sequences that hold a block table."""
        return list(self._tables)

    def usage(self) -> float:
        """Fraction of blocks in use (free cached blocks count as free: they are reusable)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_keys(self, seq_id: int) -> list[BlockKey]:
        """Keys of ``seq_id``'s full blocks hashed so far (for the tiers to look further)."""
        return self.prefix_cache.block_keys(seq_id)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.prefix_cache.stats()

    # -- prefix cache ----------------------------------------------------------
    def get_computed_blocks(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        extra_keys: ExtraKeys = (),
        owner: bytes = b"",
        origin: BlockOrigin = NO_ORIGIN,
    ) -> PrefixHit:
        """The cached head blocks of a sequence about to be admitted (no references taken).

        Call it for a sequence with no table and nothing computed; pass the answer
        to ``can_allocate`` / ``num_new_blocks_needed`` / ``allocate_slots`` with
        ``num_computed = hit.num_cached_tokens``. The hit stays valid until the next
        call that allocates blocks. ``extra_keys`` (adapter content, tenant salt)
        must be the same every time for one sequence. ``owner`` (the tenant's salt, one of
        ``extra_keys``) is recorded in the sequence's key chain and tagged on every block it
        caches, for a purge; ``origin`` (the adapter) goes with its blocks' KV events. NO_HIT
        when caching is off.
        """
        if not self.enable_prefix_caching:
            return NO_HIT
        if self._tables.get(seq_id):
            raise RuntimeError(f"sequence {seq_id} already holds blocks; look up only before admission")
        return self.prefix_cache.lookup(seq_id, token_ids, extra_keys, owner, origin, self.sliding_window)

    def cache_full_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> int:
        """After a step: make ``seq_id``'s newly computed full blocks findable; return how many.

        Idempotent and incremental. A block whose key another block holds already
        stays private: blocks are not de-duplicated, because the block tables that
        point at both must stay append-only (the runner already holds them).
        """
        if not self.enable_prefix_caching or seq_id not in self._tables:
            return 0
        table = self._tables[seq_id]
        return self.prefix_cache.register(seq_id, table, token_ids, num_computed_tokens)

    # -- admission -------------------------------------------------------------
    def can_allocate(self, seq_id: int, num_tokens: int, hit: PrefixHit = NO_HIT) -> AllocStatus:
        """Could ``seq_id`` hold ``num_tokens`` tokens of KV? NEVER if the pool is too small.

        With a ``hit``, its free cached blocks count as taken from the free pool (those inside
        the window only: the rest are padded, not taken). With a sliding window, NEVER only
        if a decode step (``window_step_blocks``) would not fit: the scheduler cuts longer
        prefills into chunks that fit (``max_chunk_tokens``).
        """
        most = self.num_blocks_for(num_tokens)
        if self.window_step_blocks is not None:
            most = min(most, self.window_step_blocks)
        if most > self.pool.num_blocks:
            return AllocStatus.NEVER
        needed = self.num_blocks_for(num_tokens)
        if hit.block_ids:
            needed += self._num_revived(hit) - hit.num_cached_blocks
        else:
            needed -= len(self._tables.get(seq_id, ()))
        if needed <= self.pool.num_free_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def num_new_blocks_needed(
        self, seq_id: int, num_computed: int, num_new: int, hit: PrefixHit = NO_HIT
    ) -> int:
        """Blocks (fresh, copy-on-write, and free cached hits revived) ``allocate_slots`` would
        take out of the free queue."""
        end = num_computed + num_new
        if hit.block_ids:
            # The hit becomes the table; writes start right after it, so nothing is copied.
            return self._num_revived(hit) + max(0, self.num_blocks_for(end) - hit.num_cached_blocks)
        table = self._tables.get(seq_id, [])
        # Blocks the window drops before this step (allocate_slots frees them first) come back.
        released = self.window.num_released(seq_id, table, num_computed, self.pool)
        table_len = len(table)
        fresh = max(0, self.num_blocks_for(end) - table_len)
        first = num_computed // self.block_size
        last = min(table_len, self.num_blocks_for(end))
        cow = sum(1 for idx in range(first, last) if self._must_copy(self.pool.blocks[table[idx]]))
        return fresh + cow - released

    def _num_revived(self, hit: PrefixHit) -> int:
        """Hit blocks inside the window that are free now: taking them empties their place in
        the free queue (those before the window are not taken)."""
        first = self.first_kept_block(hit.num_cached_tokens)
        return sum(1 for b in hit.block_ids[first:] if self.pool.blocks[b].ref_cnt == 0)

    @staticmethod
    def _must_copy(block: KVBlock) -> bool:
        # Shared blocks are copied before a write; so are keyed ones, which are
        # immutable (other sequences may find them by key at any time).
        return block.ref_cnt > 1 or block.key is not None

    # -- lifecycle -------------------------------------------------------------
    def allocate_slots(
        self, seq_id: int, num_computed: int, num_new: int, hit: PrefixHit = NO_HIT
    ) -> list[BlockCopy] | None:
        """Make room to write tokens ``num_computed .. num_computed + num_new - 1``.

        With a prefix ``hit`` (from ``get_computed_blocks``, for a sequence without a
        table), the hit blocks become the head of the table first (``num_computed``
        must equal ``hit.num_cached_tokens``). Appends fresh blocks as needed and
        replaces every shared block that the write touches with a private copy.
        Returns the block copies to run before the forward, or None (and changes
        nothing) when the pool has too few free blocks.
        """
        if hit.block_ids:
            self._check_hit(seq_id, num_computed, hit)
        elif num_new <= 0:
            return []
        else:
            # What the window dropped since the last step goes back before anything is taken.
            self.free_outside_window(seq_id, num_computed)
        if self.num_new_blocks_needed(seq_id, num_computed, num_new, hit) > self.pool.num_free_blocks:
            return None
        if self.enable_prefix_caching and hit.num_query_tokens > 0:
            self.prefix_cache.admitted(seq_id, hit)
        table = self._tables.setdefault(seq_id, [])
        # Take the hits before allocating: a free hit block sits in the free queue
        # and must not be handed out as a fresh block. Hit blocks already out of the
        # window are not taken at all: their entries are PAD from the start.
        first_kept = self.first_kept_block(num_computed) if hit.block_ids else 0
        for idx, block_id in enumerate(hit.block_ids):
            if idx < first_kept:
                table.append(PAD_BLOCK_ID)
                continue
            self.pool.take(block_id)
            table.append(block_id)
        self.window.pad_head(seq_id, first_kept)
        end = num_computed + num_new
        copies: list[BlockCopy] = []
        first = num_computed // self.block_size
        if first < self.window.num_padded(seq_id):
            raise RuntimeError(
                f"sequence {seq_id} writes from block {first}, which the sliding window already freed"
            )
        for idx in range(first, min(len(table), self.num_blocks_for(end))):
            old = table[idx]
            if self._must_copy(self.pool.blocks[old]):
                (new,) = self.pool.allocate(1)
                self.pool.decref(old)
                table[idx] = new.block_id
                copies.append(BlockCopy(old, new.block_id))
        missing = self.num_blocks_for(end) - len(table)
        if missing > 0:
            table.extend(b.block_id for b in self.pool.allocate(missing))
        return copies

    def _check_hit(self, seq_id: int, num_computed: int, hit: PrefixHit) -> None:
        if self._tables.get(seq_id):
            raise RuntimeError(f"sequence {seq_id} already holds blocks; a prefix hit must start its table")
        if num_computed != hit.num_cached_tokens:
            raise ValueError(
                f"num_computed {num_computed} != the hit's {hit.num_cached_tokens} cached tokens"
            )
        self.prefix_cache.check_fresh(hit)

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give ``child_id`` the parent's blocks, shared (ref_cnt += 1 each), and its key chain."""
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        table = self._tables.get(parent_id, [])
        for block_id in table:
            if block_id != PAD_BLOCK_ID:
                self.pool.incref(block_id)
        self._tables[child_id] = list(table)
        self.window.fork(parent_id, child_id)
        self.prefix_cache.fork(parent_id, child_id)

    def truncate(self, seq_id: int, num_tokens: int) -> int:
        """Keep only the blocks holding ``seq_id``'s first ``num_tokens`` tokens; the blocks past
        them go back (speculative tokens the target rejected). Returns how many were released.

        The released blocks hold only rejected positions, which are never registered with the
        prefix cache, so none of them carries a key this sequence's chain knows."""
        table = self._tables.get(seq_id)
        if table is None:
            return 0
        keep = self.num_blocks_for(num_tokens)
        dropped = table[keep:]
        del table[keep:]
        for block_id in reversed(dropped):
            self.pool.decref(block_id)
        return len(dropped)

    def free(self, seq_id: int) -> None:
        """Release every block of ``seq_id`` and its key chain (no-op if it holds none).

        Keyed blocks stay findable until reused, so a preempted sequence that comes
        back (looking up again, keys re-hashed) finds what was not evicted meanwhile.
        """
        self.prefix_cache.forget(seq_id)
        table = self._tables.pop(seq_id, None)
        num_padded = self.window.forget(seq_id)
        if not table:
            return
        # Free tail first so the LRU queue hands out a sequence's head blocks last:
        # those are the ones a prefix-cache hit would want back.
        for block_id in reversed(table[num_padded:]):
            self.pool.decref(block_id)

    # -- tensors ---------------------------------------------------------------
    def block_table_tensor(
        self, seq_ids: list[int], max_blocks: int | None = None, device: torch.device | None = None
    ) -> torch.Tensor:
        """Block tables of ``seq_ids`` as an int32 ``[num_seqs, max_blocks]`` tensor,
        padded with ``PAD_BLOCK_ID``."""
        width = (
            max_blocks
            if max_blocks is not None
            else max((len(self.block_table(s)) for s in seq_ids), default=0)
        )
        rows = [self.block_table(s) + [PAD_BLOCK_ID] * (width - len(self.block_table(s))) for s in seq_ids]
        return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(seq_ids), width)

    def slot(self, seq_id: int, position: int) -> int:
        """Flat KV slot of token ``position`` of ``seq_id``: block_id * block_size + offset."""
        table = self._tables[seq_id]
        block_id = table[position // self.block_size]
        if block_id == PAD_BLOCK_ID:
            raise ValueError(f"position {position} of sequence {seq_id} was freed out of the sliding window")
        return block_id * self.block_size + position % self.block_size

    # -- invariants ------------------------------------------------------------
    def check_integrity(self) -> None:
        """Blocks are conserved, ref counts equal the tables (plus promotions) holding
        them, and every keyed block a sequence holds carries that sequence's key."""
        self.pool.check_integrity()
        counts = [0] * self.pool.num_blocks
        for seq_id, table in self._tables.items():
            # PAD entries (blocks freed out of the window) are exactly the table's head.
            num_padded = self.window.check_table(seq_id, table)
            for block_id in table[num_padded:]:
                counts[block_id] += 1
        for block_id in self.pool.promoting_block_ids():
            counts[block_id] += 1
        for block in self.pool.blocks:
            if counts[block.block_id] != block.ref_cnt:
                held = counts[block.block_id]
                msg = f"block {block.block_id}: ref_cnt {block.ref_cnt} but {held} tables hold it"
                raise AssertionError(msg)
        used = sum(1 for c in counts if c > 0)
        lent = self.pool.num_lent  # to the adapter page arena (``kv_arena``)
        if used + self.pool.num_free_blocks + lent != self.pool.num_blocks:
            raise AssertionError(
                f"{used} used + {self.pool.num_free_blocks} free + {lent} lent to adapters "
                f"!= {self.pool.num_blocks} blocks"
            )
        for seq_id, table in self._tables.items():
            # A sibling may have cached a shared block past what this chain hashed yet;
            # only the keys this sequence knows can be compared.
            keys = self.prefix_cache.block_keys(seq_id)
            for idx, block_id in enumerate(table[: len(keys)]):
                if block_id == PAD_BLOCK_ID:
                    continue
                key = self.pool.blocks[block_id].key
                if key is not None and keys[idx] != key:
                    raise AssertionError(
                        f"sequence {seq_id} block {idx} (id {block_id}) is cached under a key "
                        "that is not the sequence's own"
                    )
