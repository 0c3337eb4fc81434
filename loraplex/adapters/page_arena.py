"""Where the adapter page pool's tensors live: an *arena* of whole blocks per layer.

The page pool (``page_pool.py``) lays every group's per-layer tensors out in its arena and
asks it to grow or shrink by whole blocks between steps. Two arenas:

- ``OwnedArena``: memory of its own, bounded by a byte budget (an ``AdapterManager`` used
  on its own, in tests and tools);
- ``storage/kv/kv_arena.KVPageArena``: blocks borrowed from the top of the KV cache's own
  pool (in an engine): KV blocks and adapter pages share one memory pool, S-LoRA's
  unified paging, with the KV cache first (the arena only takes free blocks, and gives
  them back before a sequence would be preempted).

An arena has ``num_chunks`` byte ranges per layer (the KV arena: the K and the V cache's
top blocks), each ``num_blocks * block_nbytes`` long; a tensor is placed inside one chunk.
"""

from __future__ import annotations

from typing import Protocol

import torch

ALIGN = 64
"""Byte alignment of every tensor placed in an arena (a cache line, an AVX-512 vector)."""


class PageArena(Protocol):
    """Per-layer byte chunks that grow and shrink by whole blocks (see the module doc)."""

    num_layers: int
    num_chunks: int
    block_nbytes: int  # bytes one block adds to each chunk of each layer

    @property
    def num_blocks(self) -> int:
        """Blocks the arena holds now."""
        ...

    @property
    def cap_blocks(self) -> int:
        """The most blocks it may ever hold (``lora_memory``): what an adapter must fit in."""
        ...

    def max_blocks(self, keep_free_blocks: int = 0) -> int:
        """The most blocks it could hold now: held + what it may take, within ``cap_blocks``
        (an arena borrowing from a pool leaves ``keep_free_blocks`` of it free)."""
        ...

    def max_blocks_beside(self, kv_blocks: int) -> int:
        """The most blocks it could ever hold while ``kv_blocks`` blocks of KV are in use."""
        ...

    def resize(self, num_blocks: int) -> None:
        """Hold ``num_blocks`` blocks (``<= max_blocks()``). Chunks' contents are not kept."""
        ...

    def chunks(self, layer: int) -> list[torch.Tensor]:
        """Layer ``layer``'s chunks: 1-D uint8 tensors of ``num_blocks * block_nbytes`` bytes."""
        ...

    def check(self) -> list[str]:
        """Errors in the arena's own bookkeeping (empty when sound)."""
        ...


class OwnedArena:
    """An arena with memory of its own: at most ``budget_bytes`` over every layer and chunk."""

    num_chunks = 1
    block_nbytes = ALIGN

    def __init__(self, num_layers: int, budget_bytes: int, device: torch.device) -> None:
        self.num_layers = num_layers
        self.budget_bytes = budget_bytes
        self.device = device
        self._num_blocks = 0
        self._chunks: list[torch.Tensor] = [self._empty(0) for _ in range(num_layers)]

    def _empty(self, num_blocks: int) -> torch.Tensor:
        return torch.empty(num_blocks * self.block_nbytes, dtype=torch.uint8, device=self.device)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def cap_blocks(self) -> int:
        return self.budget_bytes // (self.block_nbytes * self.num_chunks * self.num_layers)

    def max_blocks(self, keep_free_blocks: int = 0) -> int:
        return self.cap_blocks  # its memory is its own

    def max_blocks_beside(self, kv_blocks: int) -> int:
        return self.cap_blocks  # its memory is its own

    def resize(self, num_blocks: int) -> None:
        if not 0 <= num_blocks <= self.cap_blocks:
            raise MemoryError(f"{num_blocks} arena blocks outside [0, {self.cap_blocks}]")
        if num_blocks != self._num_blocks:
            self._chunks = [self._empty(num_blocks) for _ in range(self.num_layers)]
            self._num_blocks = num_blocks

    def chunks(self, layer: int) -> list[torch.Tensor]:
        return [self._chunks[layer]]

    def check(self) -> list[str]:
        if self._num_blocks > self.cap_blocks:
            return [f"owned arena holds {self._num_blocks} blocks > cap {self.cap_blocks}"]
        return []
