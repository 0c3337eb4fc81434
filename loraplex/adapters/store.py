"""The content-addressed adapter store: validated adapters in folders named by their version.

Layout under ``root``::

    root/<version>/adapter_config.json          version = sha256 of the content (identity.py)
    root/<version>/adapter_model.safetensors
    root/.staging-XXXX/                          work in flight (an upload, a copy), removed when it ends

One layout and one class for both users of a store:

- the gateway's persistent store (``gateway.adapter_store``), shared by replicas: uploads are
  validated in a staging folder inside it and renamed to ``root/<version>``
  (``new_staging`` / ``publish`` / ``discard`` / ``remove``; ``uploads.AdapterValidator``);
- the engine's adapter manager (``stage`` / ``release``), which serves a folder that already is
  a version of a content-addressed store *in place* (its name is the sha256 of its content, so
  reading it back checks it: nothing is copied or validated twice), and copies anything else
  (a user's folder or an archive) into its own store, so the files it serves cannot change
  under it. Folders it copied are reference counted: two ids with identical content share one.

A crash leaves only ``.staging-*`` folders: ``open`` removes those older than an hour (a
younger one may be another replica's upload in flight). Tenants' adapters are private: the root
and every folder are 0700, the files 0600.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.adapters.archive import ArchiveLimits, extract_adapter_archive, is_archive
from loraplex.adapters.errors import AdapterValidationError
from loraplex.adapters.layout import CONFIG_NAME, WEIGHTS_NAME
from loraplex.adapters.loader import (
    ParsedAdapter,
    parse_adapter,
    read_adapter,
    read_adapter_files,
    reread_adapter,
)
from loraplex.adapters.spec import BaseModelSpec

logger = logging.getLogger(__name__)

STAGING_PREFIX = ".staging-"
_STALE_STAGING_S = 3600.0
"""Staging folders older than this are leftovers of a crash (replicas may share the store, so a
younger one can be another replica's upload in flight)."""
_VERSION_NAME = re.compile(r"[0-9a-f]{64}")


def is_version_folder(folder: Path) -> bool:
    """Whether ``folder`` looks like a version of a content-addressed store (``<sha256>/`` with a config)."""
    return bool(_VERSION_NAME.fullmatch(folder.name)) and (folder / CONFIG_NAME).is_file()


@dataclass(frozen=True)
class StagedAdapter:
    """A validated adapter on disk: where it lives and what it holds."""

    folder: Path
    owned: bool  # True: a folder this store copied (deleted when its last user goes)
    parsed: ParsedAdapter


def _private(folder: Path) -> None:
    """Only this user may read an adapter: the folder 0700, its files 0600."""
    os.chmod(folder, 0o700)
    for child in folder.iterdir():
        if child.is_file() and not child.is_symlink():
            os.chmod(child, 0o600)


class AdapterStore:
    """Content-addressed adapter folders under one root; thread-safe."""

    def __init__(
        self,
        root: Path | None,
        limits: ArchiveLimits | None = None,
        copy_directories: bool = True,
    ) -> None:
        """``root`` None: a temporary folder, made on first use and deleted by ``close``.
        ``limits`` bound archives given to ``stage``; ``copy_directories=False`` serves every
        folder in place (re-checked against its version whenever it is re-read)."""
        self._root = root
        self._created_root = False
        self._limits = limits or ArchiveLimits()
        self._copy_directories = copy_directories
        self._refcounts: dict[Path, int] = {}
        self._lock = threading.Lock()

    @property
    def root(self) -> Path:
        """The store folder (created on first use; a temporary folder when none was given)."""
        with self._lock:
            if self._root is None:
                self._root = Path(tempfile.mkdtemp(prefix="loraplex-adapters-"))
                self._created_root = True
            self._root.mkdir(parents=True, exist_ok=True)
            return self._root

    def open(self) -> None:
        """Create the root and remove staging folders a crash left behind (older than an hour)."""
        root = self.root
        os.chmod(root, 0o700)
        now = time.time()
        for stale in root.glob(STAGING_PREFIX + "*"):
            try:
                if now - stale.stat().st_mtime > _STALE_STAGING_S:
                    logger.warning("removing the leftover staging folder %s", stale)
                    shutil.rmtree(stale, ignore_errors=True)
            except FileNotFoundError:
                continue

    # -- uploads (the gateway) ---------------------------------------------------------
    def path_of(self, version: str) -> Path:
        """The folder of a stored version (``Adapter.path`` is relative to the root)."""
        return self.root / version

    def new_staging(self) -> Path:
        """A fresh private folder inside the store, for one upload's files."""
        return Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.root))

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def publish(self, folder: Path, version: str) -> bool:
        """Move a validated ``folder`` (inside the store) to ``root/<version>``; False when that
        content was stored already (``folder`` is then left for ``discard``)."""
        final = self.root / version
        with self._lock:
            if final.exists():
                return False
            _private(folder)
            folder.rename(final)
            return True

    def versions_older_than(self, age_s: float) -> list[str]:
        """Stored versions whose folder is older than ``age_s`` (a younger one may be an upload
        another replica is about to commit)."""
        now = time.time()
        out = []
        for folder in self.root.iterdir():
            try:
                if _VERSION_NAME.fullmatch(folder.name) and now - folder.stat().st_mtime > age_s:
                    out.append(folder.name)
            except FileNotFoundError:
                continue
        return sorted(out)

    def remove(self, version: str) -> None:
        """Delete a stored version (once nothing references it)."""
        folder = self.path_of(version)
        if folder.parent != self.root or not folder.is_dir():
            return
        # Renamed first, so the version disappears at once even if the delete is interrupted.
        trash = self.new_staging()
        folder.rename(trash / "removed")
        shutil.rmtree(trash, ignore_errors=True)
        logger.info("removed adapter version %s from the store", version[:12])

    # -- the engine's adapter manager -----------------------------------------------------
    @property
    def owned_folders(self) -> dict[Path, int]:
        """Folders this store copied, with how many registered adapters use each."""
        with self._lock:
            return dict(self._refcounts)

    def stage(self, source: Path, spec: BaseModelSpec, max_rank: int, dtype: torch.dtype) -> StagedAdapter:
        """Validate the adapter at ``source`` (folder or archive); a version folder of a store is
        served in place, anything else is copied into this store first."""
        if not source.exists():
            raise AdapterValidationError("not_found", f"{source}: no such file or folder")
        if source.is_dir() and (not self._copy_directories or is_version_folder(source)):
            # A version folder's name is its content's sha256: reading it checks it is intact.
            expected = source.name if is_version_folder(source) else None
            return StagedAdapter(source, False, read_adapter(source, spec, max_rank, dtype, expected))
        if not source.is_dir() and not is_archive(source):
            raise AdapterValidationError(
                "pickle_format"
                if source.suffix.lower() in (".bin", ".pt", ".pth", ".pkl")
                else "bad_archive",
                f"{source}: expected a PEFT adapter folder or a .zip/.tar.gz of one",
            )
        staging = self.new_staging()
        try:
            if source.is_dir():
                files = read_adapter_files(source, spec, max_rank)
            else:
                extract_adapter_archive(source, staging, self._limits)
                files = read_adapter_files(staging, spec, max_rank)
            parsed = parse_adapter(files, spec, max_rank, dtype, str(source))
            if source.is_dir():  # write exactly the bytes that were validated
                (staging / CONFIG_NAME).write_bytes(files.config)
                (staging / WEIGHTS_NAME).write_bytes(files.weights)
            return StagedAdapter(self._keep(staging, parsed.version), True, parsed)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def _keep(self, staging: Path, version: str) -> Path:
        final = self.root / version
        with self._lock:
            if final.exists():
                shutil.rmtree(staging)  # same content is already stored
            else:
                _private(staging)
                staging.rename(final)
            self._refcounts[final] = self._refcounts.get(final, 0) + 1
        return final

    def load(
        self, staged_folder: Path, spec: BaseModelSpec, max_rank: int, dtype: torch.dtype, version: str
    ) -> ParsedAdapter:
        """Re-read a staged adapter (host-cache miss), checking it still is ``version`` (its
        values were validated when it was staged, so only the content hash is re-checked)."""
        return reread_adapter(staged_folder, spec, max_rank, dtype, version)

    def release(self, folder: Path) -> None:
        """Drop one user of a copied folder; delete it when none is left."""
        with self._lock:
            count = self._refcounts.get(folder, 0)
            if count <= 0:
                return
            if count > 1:
                self._refcounts[folder] = count - 1
                return
            del self._refcounts[folder]
        shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        """Delete every copied folder (and the root, if this store created it)."""
        with self._lock:
            folders, self._refcounts = list(self._refcounts), {}
            root, created = self._root, self._created_root
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        if root is not None and created:
            shutil.rmtree(root, ignore_errors=True)
