"""The prefix cache's per-sequence side: key chains, prompt lookups, registering full blocks.

The block pool holds the index ``key -> block_id`` and the LRU free queue; this
module walks a sequence's chain of block keys (``block_hash``) against it:

    lookup(seq_id, tokens, extra, owner, origin)  the longest run of cached head blocks (no refs
                                    taken); the first lookup starts the sequence's key chain
    admitted(seq_id, hit)           the hit became the head of the sequence's table
    register(seq_id, table, ...)    full, computed blocks become findable, tagged with the
                                    chain's owner (idempotent; no chain: an error)
    fork(parent_id, child_id)       the child continues the parent's chain
    forget(seq_id)                  the sequence dropped its blocks

With the pool's ``events`` set, each run of blocks ``register`` makes findable is one
``BlocksStored`` (GPU) with their tokens, the key before them and the chain's owner and
``origin`` (the adapter, as a router names it: ``kv_events``).

A lookup never counts the prompt's last token as cached, because the sampler needs
its logits: at most ``(len(tokens) - 1) // block_size`` blocks hit, and a prompt
that is an exact multiple of the block size recomputes its whole last block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from loraplex.kernels.metadata import PAD_BLOCK_ID, first_visible_block
from loraplex.storage.kv.block_hash import BlockKey, BlockKeyChain, ExtraKeys, root_key
from loraplex.storage.kv.block_pool import BlockPool
from loraplex.storage.kv.kv_events import GPU, NO_ORIGIN, BlockOrigin, BlocksStored


class PrefixHit(NamedTuple):
    """The head blocks of a prompt found in the cache; the scheduler hands it back to
    ``allocate_slots``, which takes the references. Valid until the next allocation."""

    block_ids: tuple[int, ...]
    keys: tuple[BlockKey, ...]  # key of each hit block, re-checked when the hit is used
    num_cached_tokens: int  # len(block_ids) * block_size: where computation starts
    num_query_tokens: int  # tokens of the prompt looked up
    num_cacheable_blocks: int  # (num_query_tokens - 1) // block_size: the most that could hit

    @property
    def num_cached_blocks(self) -> int:
        return len(self.block_ids)


NO_HIT = PrefixHit((), (), 0, 0, 0)
"""What a lookup answers when prefix caching is off."""


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters since start-up, for metrics. Hits and misses count at admission, once
    per admitted lookup; evictions count cached blocks reused for other content."""

    num_queries: int
    num_query_tokens: int
    num_hit_tokens: int
    num_hit_blocks: int
    num_miss_blocks: int  # cacheable blocks of admitted prompts that were not found
    num_evicted_blocks: int
    num_evicted_tokens: int
    num_cached_blocks: int  # findable now, in use or free

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from the cache."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class PrefixCache:
    """Key chains of live sequences and the bookkeeping of which of their blocks are cached."""

    def __init__(self, pool: BlockPool, block_size: int, fingerprint: bytes) -> None:
        self.pool = pool
        self.block_size = block_size
        self.root = root_key(fingerprint)
        self._chains: dict[int, BlockKeyChain] = {}
        self._origins: dict[int, BlockOrigin] = {}  # for KV events; absent: the base model
        # How many head blocks of each table were already handled by ``register``.
        self._num_registered: dict[int, int] = {}
        self._num_queries = 0
        self._num_query_tokens = 0
        self._num_hit_blocks = 0
        self._num_miss_blocks = 0

    def _chain(self, seq_id: int, extra_keys: ExtraKeys, owner: bytes) -> BlockKeyChain:
        chain = self._chains.get(seq_id)
        if chain is None:
            chain = self._chains[seq_id] = BlockKeyChain(self.root, self.block_size, extra_keys, owner)
        elif chain.extra_keys != tuple(extra_keys) or chain.owner != owner:
            # The extra keys carry the adapter and tenant: a change here would hand one
            # tenant's (or adapter's) KV to another. Raise even under python -O.
            raise ValueError(
                f"sequence {seq_id} was keyed with other extra keys (adapter/tenant) or another "
                "owner than now given"
            )
        return chain

    def block_keys(self, seq_id: int) -> list[BlockKey]:
        """Keys of ``seq_id``'s full blocks hashed so far ([] if it has no chain)."""
        chain = self._chains.get(seq_id)
        return list(chain.keys) if chain is not None else []

    def lookup(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        extra_keys: ExtraKeys,
        owner: bytes = b"",
        origin: BlockOrigin = NO_ORIGIN,
        sliding_window: int | None = None,
    ) -> PrefixHit:
        """Walk the prompt's full blocks and stop at the first key not cached.

        With a ``sliding_window`` (every layer's), the hit is the longest whose *window* is
        resident: head blocks that are gone come back as ``PAD_BLOCK_ID`` entries.

        The first lookup of ``seq_id`` starts its key chain, which records ``owner`` (the
        tenant's cache salt, one of ``extra_keys``) for every block it later caches;
        ``origin`` names its adapter in the KV events of those blocks.
        """
        keys = self._chain(seq_id, extra_keys, owner).update(token_ids)
        if origin != NO_ORIGIN:
            self._origins[seq_id] = origin
        num_cacheable = max(0, (len(token_ids) - 1) // self.block_size)
        bs = self.block_size
        if sliding_window is not None:
            return self._window_lookup(keys[:num_cacheable], len(token_ids), sliding_window)
        block_ids: list[int] = []
        for key in keys[:num_cacheable]:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            block_ids.append(block_id)
        n = len(block_ids)
        return PrefixHit(tuple(block_ids), tuple(keys[:n]), n * bs, len(token_ids), num_cacheable)

    def _window_lookup(self, keys: Sequence[BlockKey], num_query_tokens: int, window: int) -> PrefixHit:
        """The longest hit of ``n`` blocks whose blocks the next query (at ``n * block_size``)
        reads, ``first_visible_block .. n - 1``, are all resident; the entries before them are
        ``PAD_BLOCK_ID`` (evicted or not, they are never read). vLLM's sliding-window lookup."""
        bs = self.block_size
        found = [self.pool.lookup(key) for key in keys]
        best, run_start = 0, 0
        for idx, block_id in enumerate(found):
            if block_id is None:
                run_start = idx + 1
            elif run_start <= first_visible_block((idx + 1) * bs, window, bs):
                best = idx + 1
        first = first_visible_block(best * bs, window, bs) if best else 0
        block_ids = [PAD_BLOCK_ID] * first + [b for b in found[first:best] if b is not None]
        assert len(block_ids) == best
        return PrefixHit(tuple(block_ids), tuple(keys[:best]), best * bs, num_query_tokens, len(keys))

    def check_fresh(self, hit: PrefixHit) -> None:
        """Raise if a hit block was evicted (or re-keyed) since the lookup."""
        for block_id, key in zip(hit.block_ids, hit.keys, strict=True):
            if block_id == PAD_BLOCK_ID:
                continue  # out of the window: not taken, not read
            if self.pool.blocks[block_id].key != key:
                raise RuntimeError(
                    f"stale prefix hit: block {block_id} no longer holds key {key.hex()[:16]}; "
                    "look up again after any allocation"
                )

    def admitted(self, seq_id: int, hit: PrefixHit) -> None:
        """``hit`` is now the head of ``seq_id``'s table: count it, skip it when registering."""
        self._num_registered[seq_id] = hit.num_cached_blocks
        self._num_queries += 1
        self._num_query_tokens += hit.num_query_tokens
        self._num_hit_blocks += hit.num_cached_blocks
        self._num_miss_blocks += hit.num_cacheable_blocks - hit.num_cached_blocks

    def register(self, seq_id: int, table: Sequence[int], token_ids: Sequence[int], num_computed: int) -> int:
        """Make the blocks fully covered by ``num_computed`` tokens findable; return how many.

        Each is tagged with the owner the sequence's chain recorded at its first lookup.

        Only blocks not handled before are visited, so this is cheap to call after
        every step. A block whose key another block already holds stays keyless (see
        ``BlockPool.cache_block``: no de-duplication, tables stay append-only).
        """
        chain = self._chains.get(seq_id)
        if chain is None:
            raise RuntimeError(
                f"sequence {seq_id} has no key chain: admit it through get_computed_blocks first"
            )
        num_full = min(num_computed // self.block_size, len(table))
        start = self._num_registered.get(seq_id, 0)
        if num_full <= start:
            return 0
        # The chain may already hold keys past what is computed (a lookup hashes the
        # whole prompt); only the first ``num_full`` are used here.
        keys = chain.keys if len(chain.keys) >= num_full else chain.update(token_ids)
        if len(keys) < num_full:
            raise ValueError(f"{num_computed} tokens computed but only {len(token_ids)} token ids given")
        num_cached = 0
        run: list[int] = []  # block indices made findable in a row (one event each run)
        for idx in range(start, num_full):
            if table[idx] == PAD_BLOCK_ID:  # freed out of the sliding window before it was cached
                self._report(seq_id, chain, run, token_ids)
                continue
            block = self.pool.blocks[table[idx]]
            if block.key is not None:
                if block.key != keys[idx]:
                    raise RuntimeError(
                        f"sequence {seq_id} block {idx} (id {block.block_id}) is cached under another key"
                    )
                self._report(seq_id, chain, run, token_ids)
                continue
            if self.pool.cache_block(block.block_id, keys[idx], chain.owner):
                num_cached += 1
                run.append(idx)
            else:
                self._report(seq_id, chain, run, token_ids)
        self._report(seq_id, chain, run, token_ids)
        self._num_registered[seq_id] = num_full
        return num_cached

    def _report(self, seq_id: int, chain: BlockKeyChain, run: list[int], token_ids: Sequence[int]) -> None:
        """One ``BlocksStored`` for the blocks of ``run`` (consecutive indices), then empty it."""
        events = self.pool.events
        if not run or events is None or not events.enabled:
            run.clear()
            return
        bs = self.block_size
        first, last = run[0], run[-1]
        events.emit(
            BlocksStored(
                tuple(chain.keys[first : last + 1]),
                chain.keys[first - 1] if first > 0 else None,
                tuple(token_ids[first * bs : (last + 1) * bs]),
                GPU,
                chain.owner,
                self._origins.get(seq_id, NO_ORIGIN),
            )
        )
        run.clear()

    def fork(self, parent_id: int, child_id: int) -> None:
        chain = self._chains.get(parent_id)
        if chain is not None:
            self._chains[child_id] = chain.copy()
            self._num_registered[child_id] = self._num_registered.get(parent_id, 0)
            origin = self._origins.get(parent_id)
            if origin is not None:
                self._origins[child_id] = origin

    def forget(self, seq_id: int) -> None:
        self._chains.pop(seq_id, None)
        self._num_registered.pop(seq_id, None)
        self._origins.pop(seq_id, None)

    def num_registered(self, seq_id: int) -> int:
        return self._num_registered.get(seq_id, 0)

    def stats(self) -> PrefixCacheStats:
        evicted = self.pool.num_evicted_blocks
        return PrefixCacheStats(
            num_queries=self._num_queries,
            num_query_tokens=self._num_query_tokens,
            num_hit_tokens=self._num_hit_blocks * self.block_size,
            num_hit_blocks=self._num_hit_blocks,
            num_miss_blocks=self._num_miss_blocks,
            num_evicted_blocks=evicted,
            num_evicted_tokens=evicted * self.block_size,
            num_cached_blocks=self.pool.num_cached_blocks,
        )
