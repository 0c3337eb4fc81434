"""Erasing the disk tier's records: what ``DiskKVPool.clear`` and ``purge`` run, in bounded pieces.

A dropped or promoted block's record stays in its slot file until the slot is reused; a
reset or a deleted tenant needs it gone now, from this pool and from a restart on the same
path. The steps (``sliced``)::

    wait for the writes in flight   one finishing after the erase would leave its record on
                                    disk; waited for without holding the caller (``WAIT``)
    drop the doomed keys            ``_DROP_CHUNK`` index entries a piece
    erase the free slot files       one erased file a piece, or ``_SCAN_CHUNK`` files found
                                    with nothing to erase (a purge erases only records whose
                                    header names its owner)
    fsync the erased files          on the I/O workers after the last erase, not in a piece;
                                    the steps end once every one is done (``WAIT``)

Each piece holds the pool's lock, so no slot is claimed for a write while its file is
erased; a slot claimed between pieces is skipped (its new record replaces the old one).
The fsyncs wait for the end: an fsync commits the filesystem's journal, and a truncate or
fallocate behind one waits for it (measured: up to ~0.5 s per erase while the workers
synced the earlier ones; an fsync alone takes milliseconds, up to ~100 ms on a busy disk).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from loraplex.storage.kv.sliced import WAIT, Steps, chunks
from loraplex.storage.kv.tiers.disk_io import DiskIO
from loraplex.storage.kv.tiers.disk_slots import SlotTable

_DROP_CHUNK = 512
"""Index entries dropped per piece of a sliced purge or clear (microseconds each)."""
_SCAN_CHUNK = 64
"""Slot headers read per piece when none needs erasing (an open and a read each)."""


class RecordEraser:
    """Drops a set of the pool's blocks and erases the records left in its free slot files."""

    def __init__(self, lock: threading.Lock, slots: SlotTable, io: DiskIO) -> None:
        self._lock = lock  # the pool's
        self._slots = slots
        self._io = io

    def steps(
        self,
        doomed: Callable[[], list[bytes]],
        owner: bytes | None,
        removed: Callable[[list[bytes]], None],
    ) -> Steps[tuple[int, int]]:
        """Drop the ``doomed`` keys (asked for under the lock, once the writes in flight landed),
        then erase the records left in free slot files: every one, or with ``owner`` only its
        (``removed`` hears of the dropped keys then; a reset is one ``AllCleared``). Returns
        (blocks dropped, files erased)."""
        if self._slots.num_slots == 0:
            return 0, 0
        in_flight = self._io.writes_in_flight()
        while not all(future.done() for future in in_flight):
            yield WAIT
        with self._lock:
            gone = doomed()
        yield None
        for chunk in chunks(gone, _DROP_CHUNK):
            with self._lock:
                dropped = [key for key in chunk if self._slots.drop(key)]
            if owner is not None:
                removed(dropped)
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
                    done = self._io.files.erase(slot, owner, fsync=False)
                except OSError as exc:
                    done, error = False, exc
                self._io.dirty.discard(slot)
                if done:
                    to_sync.append(slot)
            if error is not None:
                self._io.count_io_error("erase", slot, error)
            erased += done
            scanned += 1
            if done or scanned % _SCAN_CHUNK == 0:
                yield None
        syncs = [self._io.sync_later(slot) for slot in to_sync]
        while not all(future.done() for future in syncs):
            yield WAIT
        return len(gone), erased
