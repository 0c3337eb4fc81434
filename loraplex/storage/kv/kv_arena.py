"""The adapter page arena inside the KV cache's own pool: one memory pool for KV and adapters.

S-LoRA's unified paging, in blocks: the adapter page pool (``adapters/page_pool.py``) lays
its tensors out in the *top* blocks of the KV pool, which the block pool lends
(``BlockPool.lend``). In every layer the arena is two byte ranges, the K cache's and the V
cache's top ``num_blocks`` blocks, so a block is worth the same to either side::

    KV blocks in use + free blocks + blocks lent to adapters = the pool   (check_integrity)

The policy between them is *KV first*:

- the arena grows only into free blocks, and leaves ``reserve_blocks`` free for running
  sequences (the scheduler's watermark); keyless blocks are handed to sequences lowest id
  first, so the top of the pool is free whenever there is room below it;
- before the scheduler preempts a sequence, or refuses a waiting one for lack of blocks,
  adapters no running request uses are evicted and their blocks come back
  (``AdapterManager.give_back_memory``);
- adapters hold at most ``cap_blocks`` (``lora_memory``) of the pool.

This module implements the adapters' ``PageArena`` protocol structurally (storage does not
import the adapters package).
"""

from __future__ import annotations

import torch

from loraplex.storage.kv.block_pool import BlockPool
from loraplex.storage.kv.kv_cache import KVCache


class KVPageArena:
    """The top blocks of ``cache`` / ``pool`` as the adapter page pool's arena."""

    num_chunks = 2  # per layer: the K cache's top blocks and the V cache's

    def __init__(self, cache: KVCache, pool: BlockPool, cap_blocks: int, reserve_blocks: int = 0) -> None:
        if pool.num_blocks != cache.num_blocks:
            raise ValueError(f"a pool of {pool.num_blocks} blocks for a cache of {cache.num_blocks}")
        self.cache = cache
        self.pool = pool
        self.num_layers = len(cache.k)
        self.block_nbytes = cache.k[0][0].nbytes  # one block of one layer's K (or V)
        # At least one block stays KV's, so a request of one block always fits eventually.
        self._cap = max(0, min(cap_blocks, pool.num_blocks - 1))
        self.reserve_blocks = reserve_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_lent

    @property
    def cap_blocks(self) -> int:
        return self._cap

    def max_blocks(self, keep_free_blocks: int = 0) -> int:
        spare = max(0, self.pool.num_free_blocks - max(self.reserve_blocks, keep_free_blocks))
        return min(self._cap, self.pool.num_lent + min(self.pool.lendable(), spare))

    def max_blocks_beside(self, kv_blocks: int) -> int:
        return max(0, min(self._cap, self.pool.num_blocks - kv_blocks - self.reserve_blocks))

    def resize(self, num_blocks: int) -> None:
        delta = num_blocks - self.pool.num_lent
        if delta > 0:
            if num_blocks > self.max_blocks():
                raise MemoryError(f"{num_blocks} arena blocks: at most {self.max_blocks()} now")
            self.pool.lend(delta)
        elif delta < 0:
            self.pool.unlend(-delta)

    def chunks(self, layer: int) -> list[torch.Tensor]:
        start = self.pool.limit * self.block_nbytes
        return [t.view(torch.uint8).view(-1)[start:] for t in (self.cache.k[layer], self.cache.v[layer])]

    def check(self) -> list[str]:
        errors = []
        if self.pool.num_lent > self._cap:
            errors.append(f"{self.pool.num_lent} blocks lent to adapters > cap {self._cap}")
        in_use = self.pool.num_blocks - self.pool.num_free_blocks - self.pool.num_lent
        if in_use < 0:
            errors.append(f"KV {in_use} + free {self.pool.num_free_blocks} + lent != {self.pool.num_blocks}")
        return errors
