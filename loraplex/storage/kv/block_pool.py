"""The physical KV block pool: ids, reference counts and the free-block queue.

The pool knows nothing about sequences; the block manager maps sequences to
blocks. Free blocks sit in an LRU queue (oldest freed first out), which is the
order the prefix cache will later want for eviction: a freed block that still
holds cached KV stays findable until it is handed out again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class KVBlock:
    """One physical block: ``block_size`` token slots in every layer's K and V cache."""

    block_id: int
    ref_cnt: int = 0


class BlockPool:
    """Hands out blocks and takes them back; ``ref_cnt == 0`` blocks are free."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # OrderedDict as an O(1) LRU queue: popitem(last=False) takes the oldest
        # and move_to_end / pop allow removal from the middle (prefix-cache hits).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """Free block ids in the order they would be handed out."""
        return list(self._free)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` free blocks (oldest freed first), each with ref_cnt 1."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks with only {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0, f"free block {block_id} has ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
            out.append(block)
        return out

    def incref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_cnt > 0, f"incref on free block {block_id}"
        block.ref_cnt += 1

    def decref(self, block_id: int) -> None:
        """Drop one reference; the block returns to the tail of the free queue at zero."""
        block = self.blocks[block_id]
        assert block.ref_cnt > 0, f"decref on free block {block_id}"
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self._free[block_id] = None

    def check_integrity(self) -> None:
        """Every block is either free (ref 0, queued once) or referenced (ref > 0)."""
        for block in self.blocks:
            queued = block.block_id in self._free
            if block.ref_cnt < 0 or queued != (block.ref_cnt == 0):
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, in free queue: {queued}"
                )
