"""Maps sequences to KV blocks: allocate, append slots, fork (copy-on-write), free.

A sequence's block table is the list of physical block ids holding its tokens in
order; token ``p`` lives in block ``table[p // block_size]`` at offset
``p % block_size``. Blocks are shared between sequences after ``fork`` (parallel
sampling) and carry a reference count; the first write into a shared block copies
it first (copy-on-write), so siblings never see each other's tokens.

Protocol, per step (paired verbs in the nano-vllm style):

    can_allocate(seq_id, num_tokens)  -> OK | LATER | NEVER   (admission answer)
    allocate_slots(seq_id, num_computed, num_new) -> copies | None (None = no room)
    fork(parent_id, child_id)          share every block, ref_cnt += 1
    free(seq_id)                       drop the table, blocks return at ref_cnt 0
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

from loraplex.storage.kv.block_pool import BlockPool


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
    """Owns the block tables of all live sequences on top of a ``BlockPool``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[int, list[int]] = {}

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
        return self._tables.get(seq_id, [])

    def has_table(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def seq_ids(self) -> list[int]:
        """Sequences that hold a block table."""
        return list(self._tables)

    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    # -- admission -------------------------------------------------------------
    def can_allocate(self, seq_id: int, num_tokens: int) -> AllocStatus:
        """Could ``seq_id`` hold ``num_tokens`` tokens of KV? NEVER if the pool is too small."""
        needed = self.num_blocks_for(num_tokens)
        if needed > self.pool.num_blocks:
            return AllocStatus.NEVER
        have = len(self._tables.get(seq_id, ()))
        if needed - have <= self.pool.num_free_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def num_new_blocks_needed(self, seq_id: int, num_computed: int, num_new: int) -> int:
        """Blocks (fresh + copy-on-write) that ``allocate_slots`` would take from the pool."""
        table = self._tables.get(seq_id, [])
        end = num_computed + num_new
        fresh = max(0, self.num_blocks_for(end) - len(table))
        cow = 0
        first = num_computed // self.block_size
        for idx in range(first, min(len(table), self.num_blocks_for(end))):
            if self.pool.blocks[table[idx]].ref_cnt > 1:
                cow += 1
        return fresh + cow

    # -- lifecycle -------------------------------------------------------------
    def allocate_slots(self, seq_id: int, num_computed: int, num_new: int) -> list[BlockCopy] | None:
        """Make room to write tokens ``num_computed .. num_computed + num_new - 1``.

        Appends fresh blocks as needed and replaces every shared block that the write
        touches with a private copy. Returns the block copies to run before the
        forward, or None (and changes nothing) when the pool has too few free blocks.
        """
        if num_new <= 0:
            return []
        if self.num_new_blocks_needed(seq_id, num_computed, num_new) > self.pool.num_free_blocks:
            return None
        table = self._tables.setdefault(seq_id, [])
        end = num_computed + num_new
        copies: list[BlockCopy] = []
        first = num_computed // self.block_size
        for idx in range(first, min(len(table), self.num_blocks_for(end))):
            old = table[idx]
            if self.pool.blocks[old].ref_cnt > 1:
                (new,) = self.pool.allocate(1)
                self.pool.decref(old)
                table[idx] = new.block_id
                copies.append(BlockCopy(old, new.block_id))
        missing = self.num_blocks_for(end) - len(table)
        if missing > 0:
            table.extend(b.block_id for b in self.pool.allocate(missing))
        return copies

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give ``child_id`` the parent's blocks, shared (ref_cnt += 1 each)."""
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        table = self._tables.get(parent_id, [])
        for block_id in table:
            self.pool.incref(block_id)
        self._tables[child_id] = list(table)

    def free(self, seq_id: int) -> None:
        """Release every block of ``seq_id`` (no-op if it holds none)."""
        table = self._tables.pop(seq_id, None)
        if not table:
            return
        # Free tail first so the LRU queue hands out a sequence's head blocks last:
        # those are the ones a prefix-cache hit would want back.
        for block_id in reversed(table):
            self.pool.decref(block_id)

    # -- tensors ---------------------------------------------------------------
    def block_table_tensor(
        self, seq_ids: list[int], max_blocks: int | None = None, device: torch.device | None = None
    ) -> torch.Tensor:
        """Block tables of ``seq_ids`` as an int32 ``[num_seqs, max_blocks]`` tensor (0-padded)."""
        width = (
            max_blocks
            if max_blocks is not None
            else max((len(self.block_table(s)) for s in seq_ids), default=0)
        )
        rows = [self.block_table(s) + [0] * (width - len(self.block_table(s))) for s in seq_ids]
        return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(seq_ids), width)

    def slot(self, seq_id: int, position: int) -> int:
        """Flat KV slot of token ``position`` of ``seq_id``: block_id * block_size + offset."""
        table = self._tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # -- invariants ------------------------------------------------------------
    def check_integrity(self) -> None:
        """Blocks are conserved and every ref count equals the tables that hold the block."""
        self.pool.check_integrity()
        counts = [0] * self.pool.num_blocks
        for table in self._tables.values():
            for block_id in table:
                counts[block_id] += 1
        for block in self.pool.blocks:
            if counts[block.block_id] != block.ref_cnt:
                held = counts[block.block_id]
                msg = f"block {block.block_id}: ref_cnt {block.ref_cnt} but {held} tables hold it"
                raise AssertionError(msg)
        used = sum(1 for c in counts if c > 0)
        if used + self.pool.num_free_blocks != self.pool.num_blocks:
            raise AssertionError(
                f"{used} used + {self.pool.num_free_blocks} free != {self.pool.num_blocks} blocks"
            )
