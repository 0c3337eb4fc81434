"""The disk tier: preallocated KV block files under ``disk_kv_path``, capped, LRU, checked on read.

One record file per slot (``disk_files``; record format in ``block_codec``), and
``disk_kv_cache_bytes // record_bytes`` slots, so the files never exceed the cap.
Preallocated at start-up, they turn "disk full" into a start-up warning instead of
failed writes later. The index lives in memory and is rebuilt at start-up from the
slot headers (warm restart); records of another model, layout or format, and swap
blocks of the previous process, are discarded.

Block I/O runs on a small thread pool, never on the caller's thread::

    demote_async(key, data) -> bool   copy ``data`` now, write it on a worker, then publish
    fetch(key) -> Future[block|None]  read and check on a worker; None is a (counted) miss
    remove(key, promoted=...)         forget a block (a promotion took it, or a swap ended)
    clear(keep)                       forget every other block and erase their records on disk
    purge(owner)                      forget one owner's blocks and erase their records on disk
    flush() / close()                 wait for writes in flight / and fsync, stop the workers

Write, then publish: a block is findable by ``fetch`` from memory while its write is
in flight (the caller's copy serves it) and from disk only after the whole record is
written. A crash can leave a torn record behind; its checksum then fails on the first
read after the restart and the read is a miss. So correctness does not depend on
``fsync``, which is off per write by default (``fsync_writes``) and done once for
every written file by ``close()``.

Every fault is a counted miss or error, never an exception to the caller and never
wrong data: truncated, zeroed or foreign records, flipped bits (checksum), a
directory or device in a slot's place, ENOSPC or EIO on write (the block is then
not published). A slot being read is pinned, so eviction never overwrites a record
under a reader (slot states: ``disk_slots``). The workers, fsyncs and fault counting live
in ``disk_io``; ``clear`` and ``purge`` erase records with ``disk_erase``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Collection
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType

import torch

from loraplex.storage.kv.kv_cache import KVBlockLayout
from loraplex.storage.kv.kv_events import STORAGE, KVEventLog
from loraplex.storage.kv.sliced import Steps, run_to_end
from loraplex.storage.kv.tiers import block_codec
from loraplex.storage.kv.tiers.block_codec import RecordError, RecordFault
from loraplex.storage.kv.tiers.disk_erase import RecordEraser
from loraplex.storage.kv.tiers.disk_files import RestartReport, SlotFiles, preallocate_slots, scan_slots
from loraplex.storage.kv.tiers.disk_io import DiskIO
from loraplex.storage.kv.tiers.disk_slots import PendingWrite, SlotTable
from loraplex.storage.kv.tiers.metrics import TierCounters, TierMetrics

logger = logging.getLogger(__name__)


def _done(value: torch.Tensor | None) -> Future[torch.Tensor | None]:
    future: Future[torch.Tensor | None] = Future()
    future.set_result(value)
    return future


class DiskKVPool:
    """Capped, LRU, checksummed KV block files with asynchronous I/O and warm restart."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        layout: KVBlockLayout,
        fingerprint: bytes,
        capacity_bytes: int,
        *,
        num_workers: int = 4,
        preallocate: bool = True,
        fsync_writes: bool = False,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"disk_kv_cache_bytes must be >= 0, got {capacity_bytes}")
        if num_workers < 1:
            raise ValueError(f"a disk pool needs at least one I/O worker, got {num_workers}")
        self.path = Path(path)
        self.layout = layout
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self.record_bytes = block_codec.record_bytes(layout)
        self._num_slots = capacity_bytes // self.record_bytes
        self._lock = threading.Lock()
        self._slots = SlotTable(self._num_slots)
        self._seq = 0
        self.counters = TierCounters()
        self.events: KVEventLog | None = None
        """Where blocks stored and dropped are reported (``kv_events``; a clear reports nothing)."""
        self.restart = RestartReport()
        self._files = SlotFiles(self.path, self.record_bytes)
        self._io = DiskIO(self._files, self._lock, self.counters, fsync_writes=fsync_writes)
        self._eraser = RecordEraser(self._lock, self._slots, self._io)
        if self._num_slots == 0:  # disabled: every demotion is a counted drop, nothing touches disk
            if capacity_bytes:
                logger.warning(
                    "disk_kv_cache_bytes=%d holds no KV block (one record is %d bytes): the disk tier is off",
                    capacity_bytes,
                    self.record_bytes,
                )
            return
        self._files.lock()
        self._restore_index()
        if preallocate:
            self._preallocate()
        self._io.start(num_workers)
        logger.info(
            "disk KV tier at %s: %d blocks, %.1f MiB; restored %d blocks, discarded %d",
            self.path,
            self._num_slots,
            self._num_slots * self.record_bytes / 2**20,
            self.restart.restored,
            self.restart.discarded,
        )

    # -- start-up --------------------------------------------------------------
    def _restore_index(self) -> None:
        """Warm restart: index the usable records left in the slot files, oldest write first."""
        records = scan_slots(self._files, self._num_slots, self.layout, self.fingerprint, self.restart)
        self._slots.restore((r.key, r.slot, r.owner) for r in records)
        self._seq = records[-1].seq + 1 if records else 0
        self.counters.io_errors += self.restart.unreadable
        # Records of another model or layout, torn or truncated ones: each discarded block is
        # a counted fault, so an operator sees a restart that found less than it left.
        self.counters.invalid_records += self.restart.discarded
        self.restart.removed_files = self._files.remove_beyond(self._num_slots)

    def _preallocate(self) -> None:
        for slot, exc in preallocate_slots(self._files, self._num_slots):
            self._io.count_io_error("preallocate", slot, exc)

    # -- queries ---------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_used_slots(self) -> int:
        with self._lock:
            return self._slots.num_used

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return self._slots.contains(key)

    def slot_of(self, key: bytes) -> int | None:
        with self._lock:
            return self._slots.slot_of(key)

    def is_published(self, key: bytes) -> bool:
        """True once ``key``'s record is fully on disk (not just in flight)."""
        with self._lock:
            return self._slots.is_published(key)

    def held_keys(self) -> list[bytes]:
        """Keys held (published or in flight), least recently used first."""
        with self._lock:
            return self._slots.held_keys()

    def owner_of(self, key: bytes) -> bytes:
        """The owner ``key`` was written with (b"": nobody, or not held)."""
        with self._lock:
            return self._slots.owners.get(key, b"")

    # -- writing ---------------------------------------------------------------
    def demote_async(
        self,
        key: bytes,
        data: torch.Tensor,
        *,
        persistent: bool = True,
        copy: bool = True,
        owner: bytes = b"",
    ) -> bool:
        """Copy ``data`` and write it on a worker; False (a counted drop) if no slot can take it.

        Evicts the least recently used unpinned record when the pool is full.
        ``persistent=False`` marks a swap block, which a restarted pool ignores.
        ``copy=False`` hands over a contiguous CPU tensor the caller will not touch again.
        ``owner`` (the tenant's cache salt) goes into the record's header, for ``purge``.
        """
        if tuple(data.shape) != self.layout.block_shape or data.dtype != self.layout.dtype:
            expected = (self.layout.block_shape, self.layout.dtype)
            raise ValueError(f"block is {(tuple(data.shape), data.dtype)}, expected {expected}")
        if len(key) > block_codec.MAX_KEY_BYTES:
            raise ValueError(f"block keys are at most {block_codec.MAX_KEY_BYTES} bytes, got {len(key)}")
        if len(owner) > block_codec.MAX_OWNER_BYTES:
            raise ValueError(
                f"block owners are at most {block_codec.MAX_OWNER_BYTES} bytes, got {len(owner)}"
            )
        if copy or data.device.type != "cpu" or not data.is_contiguous():
            owned = torch.empty(self.layout.block_shape, dtype=self.layout.dtype)
            owned.copy_(data)
        else:
            owned = data
        with self._lock:
            workers = self._io.workers()
            if workers is None:
                self.counters.drops += 1
                return False
            if self._slots.contains(key):  # same key, same content: refresh instead of rewriting
                self._slots.index.move_to_end(key)
                return True
            claimed = self._slots.claim()
            if claimed is None:  # every slot is being read or written
                self.counters.drops += 1
                return False
            slot, evicted = claimed
            if evicted is not None:
                self.counters.evictions += 1
                if self.events is not None:
                    self.events.removed((evicted,), STORAGE)
            header = block_codec.encode_header(
                self.layout, self.fingerprint, key, self._seq, persistent, owner
            )
            self._seq += 1
            write = PendingWrite(key, slot, owned, owner=owner)
            self._slots.start_write(write)
            self.counters.demotions += 1
            if self.events is not None:  # findable from now on: a read is served from memory
                self.events.stored((key,), STORAGE, owner)
            write.future = workers.submit(self._write_job, write, header)
            self._io.inflight.add(write.future)
            return True

    def _write_job(self, write: PendingWrite, header: bytes) -> bool:
        error: OSError | None = None
        try:
            payload = block_codec.payload_view(write.data)
            self._io.write(write.slot, header, payload)
        except OSError as exc:
            error = exc
        with self._lock:
            if write.future is not None:
                self._io.inflight.discard(write.future)
            if self._slots.finish_write(write, ok=error is None):
                self._io.dirty.add(write.slot)
                self.counters.bytes_in += self.layout.bytes_per_block
        if error is not None:
            self._io.count_io_error("write", write.slot, error)
            if self.events is not None:
                self.events.removed((write.key,), STORAGE)
        return error is None

    # -- reading ---------------------------------------------------------------
    def fetch(self, key: bytes) -> Future[torch.Tensor | None]:
        """Start reading ``key``; the future gives the checked block or None (a counted miss).

        Never raises for I/O or corruption. A block whose write is still in flight
        is served from memory at once. The returned tensor is read-only by
        contract (it may be the pool's in-flight copy).
        """
        with self._lock:
            write = self._slots.pending.get(key)
            if write is not None:
                self.counters.hits += 1
                self.counters.bytes_out += self.layout.bytes_per_block
                return _done(write.data)
            workers = self._io.workers()
            slot = None if workers is None else self._slots.pin(key)
            if slot is None or workers is None:
                self.counters.misses += 1
                return _done(None)
            return workers.submit(self._read_job, key, slot)

    def _read_job(self, key: bytes, slot: int) -> torch.Tensor | None:
        block: torch.Tensor | None = None
        io_error: OSError | None = None
        fault: RecordError | None = None
        try:
            block = block_codec.decode_record(
                self._files.read_record(slot), self.layout, self.fingerprint, key
            )
        except OSError as exc:
            io_error = exc
        except RecordError as exc:
            fault = exc
        finally:
            # Also on an unexpected error (it then reaches the future): the pin must go.
            self._end_read(key, slot, block, fault)
        if io_error is not None:
            self._io.count_io_error("read", slot, io_error)
        elif fault is not None:
            self._io.warn_once(
                f"record-{fault.fault.value}", "disk KV tier: slot %d refused (%s)", slot, fault
            )
        return block

    def _end_read(self, key: bytes, slot: int, block: torch.Tensor | None, fault: RecordError | None) -> None:
        with self._lock:
            if block is None:
                self.counters.misses += 1
                if fault is not None and fault.fault is RecordFault.CHECKSUM:
                    self.counters.checksum_failures += 1
                elif fault is not None:
                    self.counters.invalid_records += 1
                # The bad record goes; a later write reuses the slot.
                if self._slots.drop(key, slot) and self.events is not None:
                    self.events.removed((key,), STORAGE)
            else:
                self.counters.hits += 1
                self.counters.bytes_out += self.layout.bytes_per_block
            self._slots.unpin(slot)

    # -- removal ---------------------------------------------------------------
    def remove(self, key: bytes, *, promoted: bool = False) -> bool:
        """Forget ``key`` (True if held); a write in flight for it finishes but is not published."""
        with self._lock:
            if not self._slots.drop(key):
                return False
            if promoted:
                self.counters.promotions += 1
            if self.events is not None:
                self.events.removed((key,), STORAGE)
            return True

    def clear(self, keep: Collection[bytes] = ()) -> tuple[int, int]:
        """Forget every block not in ``keep`` and erase the records left in free slot files, so
        that neither this pool nor a restart on the same path finds them (a prefix-cache reset);
        (blocks dropped, files erased).

        Waits for the writes in flight first: one finishing after the erase would leave its
        record on disk. Free slots are erased too, since a promoted block's record stays in
        its file until the slot is reused. Not covered: a slot a read still pins, and writes
        another thread starts meanwhile (the engine resets on its own thread, when idle, so
        there are neither).
        """
        return run_to_end(self.clear_steps(keep))

    def clear_steps(self, keep: Collection[bytes] = ()) -> Steps[tuple[int, int]]:
        """``clear`` in bounded pieces (``sliced``): blocks written meanwhile may be dropped too
        (a reset forgets what it finds), blocks in ``keep`` never."""
        return self._eraser.steps(
            lambda: [k for k in self._slots.held_keys() if k not in keep], None, self._removed
        )

    def purge(self, owner: bytes) -> tuple[int, int]:
        """Forget every block ``owner`` owns and erase its records, with those of its promoted
        blocks left in free slot files (their headers name the owner); (blocks dropped, files
        erased). For a deleted tenant: its derived data leaves the disk now, not when LRU
        reuses the slots. Same caveats as ``clear``."""
        return run_to_end(self.purge_steps(owner))

    def purge_steps(self, owner: bytes) -> Steps[tuple[int, int]]:
        """``purge`` in bounded pieces (``sliced``); the caller stores none of ``owner``'s blocks
        from the first piece on (``TierManager``), so none appear meanwhile."""
        if not owner:
            raise ValueError("purge needs an owner: blocks of nobody are cleared, not purged")
        return self._eraser.steps(lambda: self._slots.keys_of(owner), owner, self._removed)

    def _removed(self, keys: list[bytes]) -> None:
        if self.events is not None:
            self.events.removed(keys, STORAGE)

    # -- shutdown --------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for every write in flight; True if none is left."""
        return self._io.flush(timeout_s)

    def sync(self) -> None:
        """fsync every slot file written since the last sync (durability across power loss)."""
        self._io.sync()

    def close(self) -> None:
        """Finish the writes in flight, fsync them, stop the workers and release the path."""
        if self._io.close():
            self._files.unlock()

    def __enter__(self) -> DiskKVPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- metrics and invariants ------------------------------------------------
    def metrics(self) -> TierMetrics:
        with self._lock:
            return self.counters.snapshot("disk", self._num_slots, self._slots.num_used, self.record_bytes)

    def check_integrity(self, check_files: bool = True) -> None:
        """Slots are conserved across their states (``SlotTable.check``); files stay under the cap."""
        with self._lock:
            self._slots.check()
        if self._num_slots * self.record_bytes > self.capacity_bytes:
            raise AssertionError(f"{self._num_slots} slots exceed the cap of {self.capacity_bytes} bytes")
        if check_files and self._num_slots:
            on_disk = self._files.total_bytes()
            if on_disk > self.capacity_bytes:
                raise AssertionError(
                    f"slot files hold {on_disk} bytes, over the cap of {self.capacity_bytes}"
                )
