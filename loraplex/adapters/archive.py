"""Safe extraction of an adapter from a ``.zip`` or ``.tar(.gz|.bz2|.xz)`` upload.

Every member is checked *before* anything is written: a member with an absolute path,
a ``..`` component, a backslash or drive letter, a link, a device or FIFO, or
encryption makes the whole archive ``unsafe_archive``; too many members or a member
or total size over the limits makes it ``archive_too_large``. Then only the adapter's
two files are streamed out (with a byte count, never ``extractall``) into a folder the
caller owns and removes if anything fails later.

The adapter may sit at the archive root or in one folder inside it; exactly one
``adapter_config.json`` is allowed.
"""

from __future__ import annotations

import logging
import shutil
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from loraplex.adapters.errors import AdapterValidationError
from loraplex.adapters.layout import CONFIG_NAME, WEIGHTS_NAME, check_file_names

logger = logging.getLogger(__name__)

ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
_CHUNK_BYTES = 1 << 20


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


def _tar_members(tf: tarfile.TarFile, limits: ArchiveLimits, source: str) -> list[_Member]:
    members: list[_Member] = []
    for info in tf:  # lazy: a huge member list is cut off at max_members
        if len(members) >= limits.max_members:
            raise AdapterValidationError(
                "archive_too_large", f"{source}: more than {limits.max_members} members"
            )
        name = _safe_name(info.name, source)
        if not (info.isreg() or info.isdir()):
            kind = "link" if (info.issym() or info.islnk()) else "special file"
            raise _unsafe(source, f"member {info.name!r} is a {kind}; only regular files are allowed")

        def opener(info: tarfile.TarInfo = info) -> IO[bytes]:
            fh = tf.extractfile(info)
            if fh is None:
                raise AdapterValidationError("bad_archive", f"{source}: cannot read member {info.name!r}")
            return fh

        members.append(_Member(name, int(info.size), info.isdir(), opener))
    return members


def _zip_members(zf: zipfile.ZipFile, limits: ArchiveLimits, source: str) -> list[_Member]:
    infos = zf.infolist()
    if len(infos) > limits.max_members:
        raise AdapterValidationError(
            "archive_too_large", f"{source}: {len(infos)} members, over the limit of {limits.max_members}"
        )
    members: list[_Member] = []
    for info in infos:
        name = _safe_name(info.filename, source)
        mode = (info.external_attr >> 16) & 0o170000
        if mode not in (0, 0o100000, 0o040000):  # unset, regular file, folder
            raise _unsafe(source, f"member {info.filename!r} is a link or special file")
        if info.flag_bits & 0x1:
            raise _unsafe(source, f"member {info.filename!r} is encrypted")

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


def _extract(members: list[_Member], dest: Path, limits: ArchiveLimits, source: str) -> None:
    total = 0
    for m in members:
        if m.size > limits.max_member_bytes:
            raise AdapterValidationError(
                "archive_too_large",
                f"{source}: member {m.name!r} is {m.size} bytes, over the limit of {limits.max_member_bytes}",
            )
        total += m.size
    if total > limits.max_total_bytes:
        raise AdapterValidationError(
            "archive_too_large",
            f"{source}: {total} bytes uncompressed, over the limit of {limits.max_total_bytes}",
        )
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
            with zipfile.ZipFile(archive) as zf:
                _extract(_zip_members(zf, limits, source), dest, limits, source)
        else:
            with tarfile.open(archive, mode="r:*") as tf:
                _extract(_tar_members(tf, limits, source), dest, limits, source)
    except AdapterValidationError:
        _empty(dest)
        raise
    except (OSError, EOFError, tarfile.TarError, zipfile.BadZipFile, zipfile.LargeZipFile) as exc:
        _empty(dest)
        raise AdapterValidationError("bad_archive", f"{source}: cannot read the archive ({exc})") from exc
    logger.debug("extracted adapter from %s into %s", archive, dest)


def _empty(folder: Path) -> None:
    for child in folder.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
