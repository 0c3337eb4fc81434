"""The disk tier's files: one record file per slot under ``disk_kv_path``, a lock, the start-up scan.

    disk_kv_path/
        LOCK               flock'ed by the live pool: one pool (one engine) per path
        slot_000000.kvb    one ``block_codec`` record each, ``record_bytes`` long
        slot_000001.kvb
        ...

Nothing else is stored: the pool's index is rebuilt from the slot headers at
start-up (``scan_slots``). These are plain blocking functions; ``DiskKVPool`` runs
them on its I/O workers (reads, writes) or once at start-up (scan, preallocation)
and turns every OSError into a counted error.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.storage.kv.kv_cache import KVBlockLayout
from loraplex.storage.kv.tiers import block_codec
from loraplex.storage.kv.tiers.block_codec import RecordError, RecordFault

SLOT_FILE = re.compile(r"slot_(\d{6})\.kvb")
LOCK_FILE = "LOCK"

logger = logging.getLogger(__name__)


class DiskPathInUseError(RuntimeError):
    """Another live pool (this process or another) holds ``disk_kv_path``."""


class DiskPathError(ValueError):
    """``disk_kv_path`` cannot hold the tier: a file, under a file, or not creatable."""


@dataclass
class RestartReport:
    """What the start-up scan found in ``disk_kv_path``."""

    restored: int = 0  # records indexed again
    discarded: int = 0  # records of another model, layout or format, or swap blocks
    unreadable: int = 0  # slot files that could not be read (counted as I/O errors)
    removed_files: list[str] = field(default_factory=list)  # slot files beyond the cap


@dataclass(frozen=True)
class FoundRecord:
    """A slot whose header says it holds a usable block (the payload is checked when read)."""

    seq: int  # write order
    slot: int
    key: bytes
    owner: bytes = b""


class SlotFiles:
    """Paths and raw I/O of the slot files; every method may raise OSError."""

    def __init__(self, path: Path, record_bytes: int) -> None:
        self.path = path
        self.record_bytes = record_bytes
        self._lock_fd: int | None = None

    def slot_path(self, slot: int) -> Path:
        return self.path / f"slot_{slot:06d}.kvb"

    # -- the path lock ---------------------------------------------------------
    def lock(self) -> None:
        """Create the directory and take its lock; DiskPathInUseError if another pool has it,
        DiskPathError if the path cannot be a directory of ours."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except FileExistsError as exc:
            raise DiskPathError(f"disk_kv_path {self.path} exists and is not a directory") from exc
        except OSError as exc:
            raise DiskPathError(f"disk_kv_path {self.path}: cannot create it: {exc.strerror}") from exc
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise DiskPathInUseError(
                f"disk_kv_path {self.path} is in use by another KV disk pool; give each engine its own path"
            ) from exc
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # -- start-up --------------------------------------------------------------
    def read_header(self, slot: int) -> bytes | None:
        """A full-size regular slot file's header (trimmed to one record), or None (missing, empty,
        not a file); ``OSError`` for a file shorter than one record (torn or truncated)."""
        try:
            fd = os.open(self.slot_path(slot), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and 0 < st.st_size < self.record_bytes:
                # Torn or truncated: a fault to count (the caller's "unreadable"), not an empty slot.
                raise OSError(errno.EIO, f"slot file {st.st_size} bytes, shorter than one record")
            if not stat.S_ISREG(st.st_mode) or st.st_size < self.record_bytes:
                return None
            if st.st_size > self.record_bytes:
                # Left by a layout with larger blocks: the cap counts whole files.
                os.truncate(self.slot_path(slot), self.record_bytes)
            return os.pread(fd, block_codec.HEADER_BYTES, 0)
        finally:
            os.close(fd)

    def preallocate(self, slot: int) -> None:
        """Reserve the slot file's blocks (``posix_fallocate``), so later writes do not hit ENOSPC."""
        fd = os.open(self.slot_path(slot), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < self.record_bytes:
                os.posix_fallocate(fd, 0, self.record_bytes)
        finally:
            os.close(fd)

    def remove_beyond(self, num_slots: int) -> list[str]:
        """Delete slot files numbered ``num_slots`` and up (left by a larger cap); their names."""
        removed = []
        for entry in os.scandir(self.path):
            match = SLOT_FILE.fullmatch(entry.name)
            if match and int(match.group(1)) >= num_slots and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                removed.append(entry.name)
        return sorted(removed)

    def fsync_dir(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def total_bytes(self) -> int:
        """Bytes the slot files occupy (by size), what the cap bounds."""
        total = 0
        for entry in os.scandir(self.path):
            if SLOT_FILE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
        return total

    # -- records ---------------------------------------------------------------
    def write_record(self, slot: int, header: bytes, payload: memoryview, fsync: bool) -> None:
        """Write header, payload and checksum at the start of the slot file."""
        fd = os.open(self.slot_path(slot), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            offset = 0
            for part in (header, payload, block_codec.checksum(header, payload)):
                view = memoryview(part)
                while view:
                    written = os.pwrite(fd, view, offset)
                    if written <= 0:
                        raise OSError(errno.EIO, f"pwrite wrote {written} bytes")
                    offset += written
                    view = view[written:]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def read_record(self, slot: int) -> bytearray:
        """The slot file's record bytes; RecordError(TRUNCATED) if the file is shorter."""
        record = bytearray(self.record_bytes)
        view = memoryview(record)
        fd = os.open(self.slot_path(slot), os.O_RDONLY)
        try:
            got = 0
            while got < self.record_bytes:
                n = os.preadv(fd, [view[got:]], got)
                if n == 0:
                    raise RecordError(
                        RecordFault.TRUNCATED, f"slot {slot}: {got} of {self.record_bytes} bytes"
                    )
                got += n
        finally:
            os.close(fd)
        return record

    def erase(self, slot: int, owner: bytes | None = None, *, fsync: bool = True) -> bool:
        """Empty a slot file that holds a record (or a torn one): its data blocks go back to the
        filesystem and it is preallocated again, reading as zeros (a never-written slot to
        ``scan_slots``), then fsynced (unless ``fsync=False``: the caller syncs it, with
        ``fsync_slot``). False if there was nothing to erase (missing, all-zero header) or, with
        ``owner``, if its header does not name that owner."""
        try:
            fd = os.open(self.slot_path(slot), os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            size = os.fstat(fd).st_size
            header = os.pread(fd, block_codec.HEADER_BYTES, 0) if size else b""
            if not any(header):
                return False
            if owner is not None:
                try:
                    if block_codec.parse_header(header).owner != owner:
                        return False
                except block_codec.RecordError:
                    return False  # not a record of ours: nobody's to purge
            os.ftruncate(fd, 0)
            os.posix_fallocate(fd, 0, max(size, self.record_bytes))
            if fsync:
                os.fsync(fd)
            return True
        finally:
            os.close(fd)

    def fsync_slot(self, slot: int) -> None:
        fd = os.open(self.slot_path(slot), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def scan_slots(
    files: SlotFiles, num_slots: int, layout: KVBlockLayout, fingerprint: bytes, report: RestartReport
) -> list[FoundRecord]:
    """The usable records among slots ``0 .. num_slots-1``, oldest write first, one per key.

    A record of another model, layout or format version is discarded, and so is a
    swap block (not persistent); an all-zero header is a never-written slot.
    """
    found: dict[bytes, FoundRecord] = {}
    for slot in range(num_slots):
        try:
            header = files.read_header(slot)
        except OSError:
            report.unreadable += 1
            continue
        if header is None:
            continue
        try:
            parsed = block_codec.parse_header(header)
            block_codec.check_header(parsed, layout, fingerprint)
        except RecordError as exc:
            if exc.fault is not RecordFault.BAD_HEADER or any(header):
                report.discarded += 1
            continue
        if not parsed.persistent:
            report.discarded += 1
            continue
        record = FoundRecord(parsed.seq, slot, parsed.key, parsed.owner)
        older = found.get(parsed.key)
        # Written twice (promoted, then demoted again): the newer write wins.
        if older is None or older.seq < record.seq:
            found[parsed.key] = record
    report.restored = len(found)
    return sorted(found.values(), key=lambda r: r.seq)


def preallocate_slots(files: SlotFiles, num_slots: int) -> list[tuple[int, OSError]]:
    """Preallocate every slot file; the failures. Stops at ENOSPC: the filesystem is full."""
    failures: list[tuple[int, OSError]] = []
    for slot in range(num_slots):
        try:
            files.preallocate(slot)
        except OSError as exc:  # e.g. a directory in the slot's place: its writes will fail, counted
            failures.append((slot, exc))
            if exc.errno == errno.ENOSPC:
                logger.warning(
                    "disk KV tier: %s filled up after %d of %d slots; writes to the rest may fail",
                    files.path,
                    slot,
                    num_slots,
                )
                return failures
    files.fsync_dir()
    return failures
