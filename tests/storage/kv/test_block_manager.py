"""Block manager: exact block ids, ref counts, copy-on-write, no leaks."""

from __future__ import annotations

import pytest

from loraplex.kernels.metadata import PAD_BLOCK_ID
from loraplex.storage.kv.block_manager import AllocStatus, BlockCopy, KVBlockManager


def refs(m: KVBlockManager) -> list[int]:
    return [b.ref_cnt for b in m.pool.blocks]


def test_allocate_append_exact_ids() -> None:
    m = KVBlockManager(num_blocks=8, block_size=4)
    assert m.can_allocate(1, 10) is AllocStatus.OK
    assert m.allocate_slots(1, 0, 10) == []
    assert m.block_table(1) == [0, 1, 2]
    # Tokens 10, 11 fit the partial block 2; token 12 opens block 3.
    assert m.allocate_slots(1, 10, 2) == []
    assert m.block_table(1) == [0, 1, 2]
    assert m.allocate_slots(1, 12, 1) == []
    assert m.block_table(1) == [0, 1, 2, 3]
    assert m.slot(1, 13 - 1) == 3 * 4 + 0
    assert m.allocate_slots(2, 0, 4) == []
    assert m.block_table(2) == [4]
    assert refs(m) == [1, 1, 1, 1, 1, 0, 0, 0]
    m.check_integrity()


def test_admission_answers() -> None:
    m = KVBlockManager(num_blocks=4, block_size=4)
    assert m.can_allocate(1, 17) is AllocStatus.NEVER
    assert m.can_allocate(1, 16) is AllocStatus.OK
    m.allocate_slots(1, 0, 12)
    assert m.can_allocate(2, 5) is AllocStatus.LATER
    assert m.can_allocate(2, 4) is AllocStatus.OK
    # No room: allocate_slots refuses and changes nothing.
    assert m.allocate_slots(2, 0, 8) is None
    assert not m.has_table(2) or m.block_table(2) == []
    m.check_integrity()


def test_free_returns_blocks_lru_order() -> None:
    m = KVBlockManager(num_blocks=6, block_size=2)
    m.allocate_slots(1, 0, 4)  # blocks 0, 1
    m.allocate_slots(2, 0, 2)  # block 2
    m.free(1)
    # Keyless free blocks go lowest id first (the pool's top stays free for the adapter
    # arena as long as there is room below it).
    assert m.pool.free_block_ids() == [0, 1, 3, 4, 5]
    m.allocate_slots(3, 0, 8)
    assert m.block_table(3) == [0, 1, 3, 4]
    m.free(2)
    m.free(3)
    m.check_integrity()
    assert m.num_free_blocks == 6


def test_fork_and_copy_on_write() -> None:
    m = KVBlockManager(num_blocks=10, block_size=4)
    m.allocate_slots(1, 0, 6)  # blocks 0 (full), 1 (2 of 4 used)
    m.fork(1, 2)
    m.fork(1, 3)
    assert m.block_table(2) == [0, 1]
    assert refs(m)[:2] == [3, 3]
    m.check_integrity()
    # Child 2 writes token 6 into the shared partial block 1: it gets a private copy.
    copies = m.allocate_slots(2, 6, 1)
    assert copies == [BlockCopy(src=1, dst=2)]
    assert m.block_table(2) == [0, 2]
    assert refs(m)[:3] == [3, 2, 1]
    # Child 3 the same: copy into the next free block.
    assert m.allocate_slots(3, 6, 1) == [BlockCopy(src=1, dst=3)]
    # The parent is now the only owner of block 1: no copy.
    assert m.allocate_slots(1, 6, 1) == []
    assert m.block_table(1) == [0, 1]
    assert refs(m)[:4] == [3, 1, 1, 1]
    # Writing past the shared full block 0 never copies it.
    assert m.allocate_slots(2, 7, 2) == []
    assert m.block_table(2) == [0, 2, 4]
    m.check_integrity()
    for s in (1, 2, 3):
        m.free(s)
    m.check_integrity()
    assert m.num_free_blocks == 10


def test_cow_refused_when_pool_full() -> None:
    m = KVBlockManager(num_blocks=2, block_size=4)
    m.allocate_slots(1, 0, 6)
    m.fork(1, 2)
    assert m.num_new_blocks_needed(2, 6, 1) == 1
    assert m.allocate_slots(2, 6, 1) is None
    assert m.block_table(2) == [0, 1]
    m.check_integrity()


def test_integrity_detects_corruption() -> None:
    m = KVBlockManager(num_blocks=4, block_size=4)
    m.allocate_slots(1, 0, 4)
    m.pool.blocks[0].ref_cnt = 2
    with pytest.raises(AssertionError, match="block 0"):
        m.check_integrity()


def test_block_table_tensor() -> None:
    m = KVBlockManager(num_blocks=8, block_size=2)
    m.allocate_slots(1, 0, 5)
    m.allocate_slots(2, 0, 1)
    t = m.block_table_tensor([1, 2])
    assert t.dtype.is_floating_point is False and str(t.dtype) == "torch.int32"
    assert t.tolist() == [[0, 1, 2], [3, PAD_BLOCK_ID, PAD_BLOCK_ID]]
    assert PAD_BLOCK_ID == -1
