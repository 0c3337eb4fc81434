"""Safe extraction of an adapter from a ``.zip`` or ``.tar(.gz|.bz2|.xz)`` upload.

Every member is checked *before* anything is written: a member with an absolute path,
a ``..`` component, a backslash or drive letter, a link, a device or FIFO, or
encryption makes the whole archive ``unsafe_archive``; too many members or a member
or total size over the limits makes it ``archive_too_large``. Then only the adapter's
two files are streamed out (with a byte count, never ``extractall``) into a folder the
caller owns and removes if anything fails later.

The limits stop an archive bomb at the first one crossed, before the work it would cost:

- tar: each member's declared size is checked as its header is read (reaching the next
  header of a compressed tar means decompressing this member's data), and the decompressed
  stream itself is cut off past ``max_total_bytes`` plus the headers (a pax header's data is
  read whole by ``tarfile``);
- zip: the end-of-central-directory record is read first; an archive declaring too many
  entries, or a central directory larger than ``max_members`` entries can need, is refused
  before ``zipfile`` builds its member list (it parses the whole central directory);
- both: what a member really decompresses to is counted as it is written.

The adapter may sit at the archive root or in one folder inside it; exactly one
``adapter_config.json`` is allowed.
"""

from __future__ import annotations

import bz2
import gzip
import io
import logging
import lzma
import shutil
import struct
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from loraplex.adapters.errors import AdapterValidationError
from loraplex.adapters.layout import CONFIG_NAME, WEIGHTS_NAME, check_file_names

logger = logging.getLogger(__name__)

ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
_CHUNK_BYTES = 1 << 20
_TAR_BLOCK = 512
_ZIP_CD_BYTES_PER_ENTRY = 4096
"""Central directory bytes allowed per entry (46 fixed, then the name, extra fields, comment)."""
_EOCD = struct.Struct("<4s4H2LH")
_EOCD_SIGNATURE = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")


@dataclass(frozen=True)
class ArchiveLimits:
    """Bounds on an uploaded archive, checked from its headers before extraction."""

    max_members: int = 256
    """Entries (files and folders) in the archive."""
    max_member_bytes: int = 4 << 30
    """Uncompressed size of one member."""
    max_total_bytes: int = 8 << 30
    """Uncompressed size of all members together."""


@dataclass(frozen=True)
class _Member:
    name: str  # normalised posix path inside the archive
    size: int
    is_dir: bool
    open: Callable[[], IO[bytes]]


def is_archive(path: Path) -> bool:
    """Whether ``path`` names an archive by its suffix."""
    return path.name.lower().endswith(ARCHIVE_SUFFIXES)


def _unsafe(source: str, message: str) -> AdapterValidationError:
    return AdapterValidationError("unsafe_archive", f"{source}: {message}")


def _safe_name(raw: str, source: str) -> str:
    if "\\" in raw or "\x00" in raw:
        raise _unsafe(source, f"member {raw!r} has a backslash or NUL in its path")
    if raw.startswith("/") or (len(raw) >= 2 and raw[1] == ":"):
        raise _unsafe(source, f"member {raw!r} has an absolute path")
    parts = PurePosixPath(raw).parts
    if ".." in parts:
        raise _unsafe(source, f"member {raw!r} escapes the archive with '..' (path traversal)")
    return "/".join(parts)


def _too_large(source: str, message: str) -> AdapterValidationError:
    return AdapterValidationError("archive_too_large", f"{source}: {message}")


class _Sizes:
    """Running checks of member sizes against the limits, one member at a time."""

    def __init__(self, limits: ArchiveLimits, source: str) -> None:
        self.limits = limits
        self.source = source
        self.total = 0
        self.count = 0

    def add(self, name: str, size: int) -> None:
        self.count += 1
        if self.count > self.limits.max_members:
            raise _too_large(self.source, f"more than {self.limits.max_members} members")
        if size > self.limits.max_member_bytes:
            raise _too_large(
                self.source,
                f"member {name!r} is {size} bytes, over the limit of {self.limits.max_member_bytes}",
            )
        self.total += size
        if self.total > self.limits.max_total_bytes:
            raise _too_large(self.source, f"over {self.limits.max_total_bytes} bytes uncompressed, the limit")


class _CappedStream(io.RawIOBase):
    """A decompressed stream that refuses to produce more than ``cap`` bytes (seeks included:
    moving forward in a compressed stream decompresses what it skips)."""

    def __init__(self, inner: IO[bytes], cap: int, source: str) -> None:
        super().__init__()
        self.inner = inner
        self.cap = cap
        self.source = source

    def _check(self, pos: int) -> None:
        if pos > self.cap:
            raise _too_large(self.source, f"decompresses to over {self.cap} bytes")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = self.cap + 1 - self.inner.tell()
        self._check(self.inner.tell() + size - 1 if size > 0 else 0)
        return self.inner.read(size)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset, whence = self.inner.tell() + offset, io.SEEK_SET
        if whence == io.SEEK_SET:
            self._check(offset)
            return self.inner.seek(offset)
        raise io.UnsupportedOperation("seek from the end of a compressed stream")

    def tell(self) -> int:
        return self.inner.tell()

    def close(self) -> None:
        self.inner.close()
        super().close()


def _decompressed(archive: Path) -> IO[bytes]:
    name = archive.name.lower()
    if name.endswith((".tar.gz", ".tgz")):
        return gzip.open(archive, "rb")  # type: ignore[return-value]
    if name.endswith(".tar.bz2"):
        return bz2.open(archive, "rb")
    if name.endswith(".tar.xz"):
        return lzma.open(archive, "rb")
    return archive.open("rb")


@contextmanager
def _open_tar(archive: Path, limits: ArchiveLimits, source: str) -> Iterator[tarfile.TarFile]:
    """The tar inside ``archive``, its decompressed stream capped at what the limits allow."""
    # Headers (and pax data) come on top of the members' data: one block each, padding included.
    cap = limits.max_total_bytes + (4 * limits.max_members + 4) * _TAR_BLOCK + (1 << 20)
    with (
        _CappedStream(_decompressed(archive), cap, source) as stream,
        tarfile.open(fileobj=stream, mode="r:") as tf,
    ):
        yield tf


def _tar_members(tf: tarfile.TarFile, limits: ArchiveLimits, source: str) -> list[_Member]:
    members: list[_Member] = []
    sizes = _Sizes(limits, source)
    for info in tf:  # lazy: each header is checked before the next one is read
        name = _safe_name(info.name, source)
        if not (info.isreg() or info.isdir()):
            kind = "link" if (info.issym() or info.islnk()) else "special file"
            raise _unsafe(source, f"member {info.name!r} is a {kind}; only regular files are allowed")
        sizes.add(info.name, int(info.size))

        def opener(info: tarfile.TarInfo = info) -> IO[bytes]:
            fh = tf.extractfile(info)
            if fh is None:
                raise AdapterValidationError("bad_archive", f"{source}: cannot read member {info.name!r}")
            return fh

        members.append(_Member(name, int(info.size), info.isdir(), opener))
    return members


def _check_zip_directory(archive: Path, limits: ArchiveLimits, source: str) -> None:
    """Read the end-of-central-directory record (and its zip64 form) before ``zipfile`` parses
    the central directory: refuse too many entries, or a directory too large for that many."""
    size = archive.stat().st_size
    tail_bytes = min(size, _EOCD.size + 0xFFFF)  # the record, then a comment of up to 64 KiB
    with archive.open("rb") as fh:
        fh.seek(size - tail_bytes)
        tail = fh.read(tail_bytes)
        at = tail.rfind(_EOCD_SIGNATURE)
        if at < 0 or len(tail) - at < _EOCD.size:
            raise AdapterValidationError("bad_archive", f"{source}: not a zip archive (no end record)")
        _, _, _, _, entries, cd_size, _, _ = _EOCD.unpack_from(tail, at)
        locator = at - 20
        if locator >= 0 and tail[locator : locator + 4] == _ZIP64_LOCATOR:
            (zip64_at,) = struct.unpack_from("<Q", tail, locator + 8)
            fh.seek(zip64_at)
            record = fh.read(_ZIP64_EOCD.size)
            if len(record) == _ZIP64_EOCD.size:
                fields = _ZIP64_EOCD.unpack(record)
                entries, cd_size = max(entries, fields[7]), max(cd_size, fields[8])
    if entries > limits.max_members:
        raise _too_large(source, f"{entries} members, over the limit of {limits.max_members}")
    if cd_size > limits.max_members * _ZIP_CD_BYTES_PER_ENTRY:
        raise _too_large(
            source, f"its central directory is {cd_size} bytes, too large for {limits.max_members} members"
        )


def _zip_members(zf: zipfile.ZipFile, limits: ArchiveLimits, source: str) -> list[_Member]:
    members: list[_Member] = []
    sizes = _Sizes(limits, source)
    for info in zf.infolist():
        name = _safe_name(info.filename, source)
        mode = (info.external_attr >> 16) & 0o170000
        if mode not in (0, 0o100000, 0o040000):  # unset, regular file, folder
            raise _unsafe(source, f"member {info.filename!r} is a link or special file")
        if info.flag_bits & 0x1:
            raise _unsafe(source, f"member {info.filename!r} is encrypted")
        sizes.add(info.filename, int(info.file_size))

        def opener(info: zipfile.ZipInfo = info) -> IO[bytes]:
            return zf.open(info)

        members.append(_Member(name, int(info.file_size), info.is_dir(), opener))
    return members


def _copy_limited(src: IO[bytes], dst_path: Path, max_bytes: int, source: str, name: str) -> None:
    written = 0
    with dst_path.open("xb") as dst:
        while chunk := src.read(_CHUNK_BYTES):
            written += len(chunk)
            if written > max_bytes:  # headers can lie; count what really comes out
                raise AdapterValidationError(
                    "archive_too_large", f"{source}: member {name!r} is larger than its header says"
                )
            dst.write(chunk)


def _extract(members: list[_Member], dest: Path, source: str) -> None:
    configs = [m for m in members if not m.is_dir and PurePosixPath(m.name).name == CONFIG_NAME]
    if len(configs) > 1:
        raise AdapterValidationError(
            "bad_archive", f"{source}: {len(configs)} copies of {CONFIG_NAME}; upload one adapter per archive"
        )
    folder = str(PurePosixPath(configs[0].name).parent) if configs else "."
    in_folder = {
        PurePosixPath(m.name).name: m
        for m in members
        if not m.is_dir and str(PurePosixPath(m.name).parent) == folder
    }
    check_file_names(in_folder, source)
    for wanted in (CONFIG_NAME, WEIGHTS_NAME):
        member = in_folder[wanted]
        with member.open() as fh:
            _copy_limited(fh, dest / wanted, member.size, source, member.name)


def extract_adapter_archive(archive: Path, dest: Path, limits: ArchiveLimits) -> None:
    """Extract the adapter in ``archive`` into the empty folder ``dest`` (config + safetensors only).

    On failure ``dest`` is emptied again; the caller removes ``dest`` itself.
    """
    source = archive.name
    try:
        if archive.name.lower().endswith(".zip"):
            _check_zip_directory(archive, limits, source)
            with zipfile.ZipFile(archive) as zf:
                _extract(_zip_members(zf, limits, source), dest, source)
        else:
            with _open_tar(archive, limits, source) as tf:
                _extract(_tar_members(tf, limits, source), dest, source)
    except AdapterValidationError:
        _empty(dest)
        raise
    except (
        OSError,
        EOFError,
        ValueError,
        struct.error,
        lzma.LZMAError,
        tarfile.TarError,
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        NotImplementedError,
    ) as exc:
        _empty(dest)
        raise AdapterValidationError("bad_archive", f"{source}: cannot read the archive ({exc})") from exc
    logger.debug("extracted adapter from %s into %s", archive, dest)


def _empty(folder: Path) -> None:
    for child in folder.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
