"""The sliding window over block tables: which entries a sequence's window has left behind.

Sliding window (``sliding_window`` = W, for models whose every layer attends to the last W
positions only: Mistral, Qwen2 with ``use_sliding_window`` on all layers). A query at
position ``p`` reads keys ``p - W < k <= p``, and positions only grow, so once a sequence's
next query sits at ``p`` every block before ``first_kept_block(p)`` is dead for it:
``free_outside`` returns those blocks to the pool and leaves ``PAD_BLOCK_ID`` in
their table entries (the table keeps its length, so entry ``i`` is still token block ``i``;
the attention kernels, given the window, never read entries before the first visible
block). A windowed sequence so holds at most ``step_blocks`` blocks at a decode
step (``ceil((W + block_size - 1) / block_size)``, about ``W / block_size + 1``) however
long its context; admission and ``KVBlockManager.num_new_blocks_needed`` count only the
entries a step keeps. A freed block that was cached keeps its key and its KV (it waits in
the LRU free queue like any freed cached block) until the pool reuses it, when the key
leaves the index: no prefix entry ever points at missing KV. A prefix-cache hit is still
the unbroken run of resident blocks from the prompt's start (so a hit never needs a block
that is gone); ``KVBlockManager.allocate_slots`` takes only the hit blocks inside the window
and pads the rest. Models that mix windowed and global layers (Gemma 2/3, Qwen2 with
``max_window_layers``) free nothing: their global layers need every block (one table for
all layers).

``KVBlockManager`` owns one ``BlockWindow`` (also without a window: then nothing is padded)
and the tables; the window keeps how many leading entries of each table are PAD.
"""

from __future__ import annotations

from loraplex.kernels.metadata import PAD_BLOCK_ID, first_visible_block
from loraplex.storage.kv.block_pool import BlockPool


class BlockWindow:
    """The window's arithmetic in blocks, and the PAD head of each sequence's table."""

    def __init__(self, sliding_window: int | None, block_size: int) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 (or None), got {sliding_window}")
        # Every layer's window (None: some layer attends to the whole context; nothing is freed).
        self.size = sliding_window
        self.block_size = block_size
        # Leading PAD entries of each table (blocks freed out of the window), so freeing
        # after every step looks only at the blocks that just left the window.
        self._num_padded: dict[int, int] = {}
        self.num_freed_blocks = 0  # since start-up, for tests and metrics

    # -- the window in blocks --------------------------------------------------
    def first_kept_block(self, position: int) -> int:
        """The first table entry a query at ``position`` (or any later one) reads: the block
        of key ``position - W + 1``; 0 without a window. Entries before it may be freed."""
        # The kernels' own rule (``metadata.first_visible_block``): they never read before it.
        return first_visible_block(position, self.size, self.block_size)

    @property
    def step_blocks(self) -> int | None:
        """The most blocks a windowed sequence holds at a decode step, at any context length
        (None without a window): the window's ``W`` keys plus the new token may straddle
        ``ceil((W + block_size - 1) / block_size)`` blocks."""
        if self.size is None:
            return None
        return -(-(self.size + self.block_size - 1) // self.block_size)

    def max_chunk_tokens(self, num_blocks: int) -> int | None:
        """The longest prefill chunk whose blocks (the window before it included) fit a pool of
        ``num_blocks``; None without a window (then a sequence must fit the pool whole)."""
        if self.size is None:
            return None
        return max(0, num_blocks * self.block_size - self.size - self.block_size + 2)

    # -- each table's PAD head -------------------------------------------------
    def num_padded(self, seq_id: int) -> int:
        """Leading entries of ``seq_id``'s table that are PAD (freed out of the window)."""
        return self._num_padded.get(seq_id, 0)

    def free_outside(self, seq_id: int, table: list[int], next_position: int, pool: BlockPool) -> int:
        """Give ``pool`` back the blocks of ``table`` no query at ``next_position`` or later reads,
        leaving ``PAD_BLOCK_ID`` in their entries; how many. Idempotent; a no-op without a window."""
        if not table or self.size is None:
            return 0
        first = min(self.first_kept_block(next_position), len(table))
        start = self.num_padded(seq_id)
        if first <= start:
            return 0
        for idx in range(start, first):
            block_id = table[idx]
            table[idx] = PAD_BLOCK_ID
            pool.decref(block_id)
        self._num_padded[seq_id] = first
        self.num_freed_blocks += first - start
        return first - start

    def num_released(self, seq_id: int, table: list[int], num_computed: int, pool: BlockPool) -> int:
        """Blocks ``free_outside(seq_id, table, num_computed)`` would return to the free queue
        (those no other table shares)."""
        if self.size is None or not table:
            return 0
        released = 0
        for idx in range(self.num_padded(seq_id), min(self.first_kept_block(num_computed), len(table))):
            released += pool.blocks[table[idx]].ref_cnt == 1
        return released

    def pad_head(self, seq_id: int, num_entries: int) -> None:
        """``seq_id``'s table starts with ``num_entries`` PAD entries (a hit's blocks before the
        window, never taken)."""
        if num_entries:
            self._num_padded[seq_id] = num_entries

    def fork(self, parent_id: int, child_id: int) -> None:
        if parent_id in self._num_padded:
            self._num_padded[child_id] = self._num_padded[parent_id]

    def forget(self, seq_id: int) -> int:
        """``seq_id``'s table is gone; how many of its leading entries were PAD."""
        return self._num_padded.pop(seq_id, 0)

    def check_table(self, seq_id: int, table: list[int]) -> int:
        """PAD entries are exactly ``table``'s head (and only with a window); how many."""
        num_padded = self.num_padded(seq_id)
        if self.size is None and num_padded:
            raise AssertionError(f"sequence {seq_id} has PAD entries but there is no sliding window")
        if any(b != PAD_BLOCK_ID for b in table[:num_padded]) or PAD_BLOCK_ID in table[num_padded:]:
            raise AssertionError(
                f"sequence {seq_id}: PAD entries are not exactly its first {num_padded} (freed out of "
                "the window)"
            )
        return num_padded
