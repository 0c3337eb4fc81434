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
under a reader (slot states: ``disk_slots``).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from types import TracebackType

import torch

from loraplex.storage.kv.kv_cache import KVBlockLayout
from loraplex.storage.kv.kv_events import STORAGE, KVEventLog
from loraplex.storage.kv.sliced import WAIT, Steps, chunks, run_to_end
from loraplex.storage.kv.tiers import block_codec
from loraplex.storage.kv.tiers.block_codec import RecordError, RecordFault
from loraplex.storage.kv.tiers.disk_files import RestartReport, SlotFiles, preallocate_slots, scan_slots
from loraplex.storage.kv.tiers.disk_slots import PendingWrite, SlotTable
from loraplex.storage.kv.tiers.metrics import TierCounters, TierMetrics

logger = logging.getLogger(__name__)

_DROP_CHUNK = 512
"""Index entries dropped per piece of a sliced purge or clear (microseconds each)."""
_SCAN_CHUNK = 64
"""Slot headers read per piece when none needs erasing (an open and a read each)."""


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
        self._fsync_writes = fsync_writes
        self._lock = threading.Lock()
        self._slots = SlotTable(self._num_slots)
        self._inflight: set[Future[bool]] = set()
        self._dirty: set[int] = set()  # written since the last sync
        self._seq = 0
        self._closed = False
        self._warned: set[str] = set()
        self.counters = TierCounters()
        self.events: KVEventLog | None = None
        """Where blocks stored and dropped are reported (``kv_events``; a clear reports nothing)."""
        self.restart = RestartReport()
        self._files = SlotFiles(self.path, self.record_bytes)
        self._executor: ThreadPoolExecutor | None = None
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
        self._executor = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="kv-disk")
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
            self._count_io_error("preallocate", slot, exc)

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
            if self._closed or self._executor is None:
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
            write.future = self._executor.submit(self._write_job, write, header)
            self._inflight.add(write.future)
            return True

    def _write_job(self, write: PendingWrite, header: bytes) -> bool:
        error: OSError | None = None
        try:
            payload = block_codec.payload_view(write.data)
            self._files.write_record(write.slot, header, payload, self._fsync_writes)
        except OSError as exc:
            error = exc
        with self._lock:
            if write.future is not None:
                self._inflight.discard(write.future)
            if self._slots.finish_write(write, ok=error is None):
                self._dirty.add(write.slot)
                self.counters.bytes_in += self.layout.bytes_per_block
        if error is not None:
            self._count_io_error("write", write.slot, error)
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
            slot = None if self._closed or self._executor is None else self._slots.pin(key)
            if slot is None or self._executor is None:
                self.counters.misses += 1
                return _done(None)
            return self._executor.submit(self._read_job, key, slot)

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
            self._count_io_error("read", slot, io_error)
        elif fault is not None:
            self._warn_once(f"record-{fault.fault.value}", "disk KV tier: slot %d refused (%s)", slot, fault)
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
        return self._drop_and_erase_steps(lambda: [k for k in self._slots.held_keys() if k not in keep], None)

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
        return self._drop_and_erase_steps(lambda: self._slots.keys_of(owner), owner)

    def _drop_and_erase_steps(
        self, doomed: Callable[[], list[bytes]], owner: bytes | None
    ) -> Steps[tuple[int, int]]:
        """Drop the ``doomed`` keys, then erase the records left in free slot files; a piece is
        ``_DROP_CHUNK`` keys dropped, one file erased, or ``_SCAN_CHUNK`` files found with
        nothing to erase. Each piece holds the lock, so no slot is claimed for a write while
        its file is erased; a slot claimed between pieces is skipped (its new record replaces
        the old one). The fsync of each erased file (milliseconds, up to ~100 ms on a busy
        disk) runs on the I/O workers after the last erase, not in a piece: the steps end once
        every one is done, waiting for them without holding the caller (``sliced.WAIT``)."""
        if self._num_slots == 0:
            return 0, 0
        # The writes in flight land first (one finishing after the erase would leave its record
        # on disk), waited for without blocking the caller: they may queue behind other I/O.
        with self._lock:
            in_flight = list(self._inflight)
        while not all(future.done() for future in in_flight):
            yield WAIT
        with self._lock:
            gone = doomed()
        yield None
        for chunk in chunks(gone, _DROP_CHUNK):
            with self._lock:
                dropped = [key for key in chunk if self._slots.drop(key)]
            if owner is not None and self.events is not None:  # a reset is one AllCleared
                self.events.removed(dropped, STORAGE)
            yield None
        with self._lock:
            free = self._slots.free_slots()
        erased = scanned = 0
        to_sync: list[int] = []
        for slot in free:
            error: OSError | None = None
            with self._lock:
                if not self._slots.is_free(slot):
                    continue
                try:
                    done = self._files.erase(slot, owner, fsync=False)
                except OSError as exc:
                    done, error = False, exc
                self._dirty.discard(slot)
                if done:
                    to_sync.append(slot)
            if error is not None:
                self._count_io_error("erase", slot, error)
            erased += done
            scanned += 1
            if done or scanned % _SCAN_CHUNK == 0:
                yield None
        # Synced only now, after every erase: an fsync commits the filesystem's journal, and a
        # truncate or fallocate behind one waits for it (measured: up to ~0.5 s per erase while
        # the workers synced the earlier ones).
        syncs = [self._sync_later(slot) for slot in to_sync]
        while not all(future.done() for future in syncs):
            yield WAIT
        return len(gone), erased

    def _sync_later(self, slot: int) -> Future[None]:
        """fsync ``slot``'s file on an I/O worker (at once, without workers); errors are counted."""

        def sync() -> None:
            try:
                self._files.fsync_slot(slot)
            except OSError as exc:
                self._count_io_error("erase", slot, exc)

        if self._executor is None or self._closed:
            sync()
            future: Future[None] = Future()
            future.set_result(None)
            return future
        return self._executor.submit(sync)

    # -- shutdown --------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for every write in flight; True if none is left."""
        with self._lock:
            futures = list(self._inflight)
        _, not_done = wait_futures(futures, timeout=timeout_s)
        return not not_done

    def sync(self) -> None:
        """fsync every slot file written since the last sync (durability across power loss)."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        for slot in sorted(dirty):
            try:
                self._files.fsync_slot(slot)
            except OSError as exc:
                self._count_io_error("sync", slot, exc)

    def close(self) -> None:
        """Finish the writes in flight, fsync them, stop the workers and release the path."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self.sync()
        self._files.unlock()

    def __enter__(self) -> DiskKVPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- metrics and invariants ------------------------------------------------
    def _count_io_error(self, what: str, slot: int, exc: OSError) -> None:
        """Count and log an OSError; the caller must not hold the lock."""
        with self._lock:
            self.counters.io_errors += 1
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        self._warn_once(f"{what}-{code}", "disk KV tier: %s of slot %d failed: %s", what, slot, exc)

    def _warn_once(self, kind: str, msg: str, *args: object) -> None:
        # A full or failing disk fails every write: log the first of each kind, then quietly.
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        logger.log(logging.WARNING if first else logging.DEBUG, msg, *args)

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
