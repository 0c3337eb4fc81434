"""The disk tier's I/O workers and what they leave behind: writes in flight, files to fsync, faults.

``DiskKVPool`` owns one and shares its lock with it (every field here changes under that
lock); the pool decides what to read and write, this runs it off the caller's thread::

    workers()            the thread pool jobs are submitted to, or None (closed, or the tier is off)
    write(slot, ...)     a record written on a worker, fsynced at once only with ``fsync_writes``
    inflight / dirty     the writes not finished yet / the slot files written since the last sync
    sync_later(slot)     one file's fsync on a worker (an erase's, after the last erase)
    flush() / sync()     wait for the writes in flight / fsync every dirty file
    close()              finish the writes in flight, stop the workers, fsync what they wrote

Every OSError is a counted ``io_errors`` and a log line: a warning for the first of each
kind (a full or failing disk fails every write), then quietly at debug level.
"""

from __future__ import annotations

import errno
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from loraplex.storage.kv.tiers.disk_files import SlotFiles
from loraplex.storage.kv.tiers.metrics import TierCounters

logger = logging.getLogger(__name__)


class DiskIO:
    """Runs the disk pool's file I/O on worker threads and counts its faults."""

    def __init__(
        self, files: SlotFiles, lock: threading.Lock, counters: TierCounters, *, fsync_writes: bool
    ) -> None:
        self.files = files
        self._lock = lock  # the pool's
        self._counters = counters  # the pool's: ``io_errors`` is bumped here
        self._fsync_writes = fsync_writes
        self.executor: ThreadPoolExecutor | None = None
        self.inflight: set[Future[bool]] = set()
        self.dirty: set[int] = set()  # written since the last sync
        self.closed = False
        self._warned: set[str] = set()

    def start(self, num_workers: int) -> None:
        self.executor = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="kv-disk")

    def workers(self) -> ThreadPoolExecutor | None:
        """Where to submit a job now, or None once closed (or never started); under the lock."""
        return None if self.closed else self.executor

    def write(self, slot: int, header: bytes, payload: memoryview) -> None:
        """Write one record into ``slot``'s file (on a worker); raises OSError."""
        self.files.write_record(slot, header, payload, self._fsync_writes)

    def sync_later(self, slot: int) -> Future[None]:
        """fsync ``slot``'s file on an I/O worker (at once, without workers); errors are counted."""

        def sync() -> None:
            try:
                self.files.fsync_slot(slot)
            except OSError as exc:
                self.count_io_error("erase", slot, exc)

        if self.executor is None or self.closed:
            sync()
            future: Future[None] = Future()
            future.set_result(None)
            return future
        return self.executor.submit(sync)

    def writes_in_flight(self) -> list[Future[bool]]:
        with self._lock:
            return list(self.inflight)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for every write in flight; True if none is left."""
        _, not_done = wait_futures(self.writes_in_flight(), timeout=timeout_s)
        return not not_done

    def sync(self) -> None:
        """fsync every slot file written since the last sync (durability across power loss)."""
        with self._lock:
            dirty, self.dirty = self.dirty, set()
        for slot in sorted(dirty):
            try:
                self.files.fsync_slot(slot)
            except OSError as exc:
                self.count_io_error("sync", slot, exc)

    def close(self) -> bool:
        """Finish the writes in flight, stop the workers, fsync them; False if closed already."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
        if self.executor is not None:
            self.executor.shutdown(wait=True)
        self.sync()
        return True

    def count_io_error(self, what: str, slot: int, exc: OSError) -> None:
        """Count and log an OSError; the caller must not hold the lock."""
        with self._lock:
            self._counters.io_errors += 1
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        self.warn_once(f"{what}-{code}", "disk KV tier: %s of slot %d failed: %s", what, slot, exc)

    def warn_once(self, kind: str, msg: str, *args: object) -> None:
        # A full or failing disk fails every write: log the first of each kind, then quietly.
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        logger.log(logging.WARNING if first else logging.DEBUG, msg, *args)
