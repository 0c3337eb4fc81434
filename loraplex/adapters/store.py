"""The disk tier: validated adapters in content-addressed folders the manager owns.

Layout under ``root``::

    root/<version>/adapter_config.json          version = sha256 (see identity.py)
    root/<version>/adapter_model.safetensors
    root/.staging-XXXX/                          in-flight uploads, removed on failure

An upload is extracted (archives) or copied (folders) into a fresh staging folder,
validated there, and only then renamed to its version: a rejected adapter leaves no
files behind, and a crash leaves only ``.staging-*`` folders, which the next store
on the same root deletes. Folders are reference counted, so two ids with identical
content share one copy. With ``copy_directories=False`` an uploaded folder is served
in place (not copied) and re-checked against its version whenever it is re-read.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.adapters.archive import ArchiveLimits, extract_adapter_archive, is_archive
from loraplex.adapters.errors import AdapterValidationError
from loraplex.adapters.layout import CONFIG_NAME, WEIGHTS_NAME
from loraplex.adapters.loader import ParsedAdapter, parse_adapter, read_adapter, read_adapter_files
from loraplex.adapters.spec import BaseModelSpec

logger = logging.getLogger(__name__)

_STAGING_PREFIX = ".staging-"


@dataclass(frozen=True)
class StagedAdapter:
    """A validated adapter on disk: where it lives and what it holds."""

    folder: Path
    owned: bool  # True: a folder of this store (deleted when its last user goes)
    parsed: ParsedAdapter


class AdapterStore:
    """Stages uploads into validated, content-addressed folders; thread-safe."""

    def __init__(
        self,
        root: Path | None,
        limits: ArchiveLimits,
        copy_directories: bool = True,
    ) -> None:
        self._root = root
        self._created_root = False
        self._limits = limits
        self._copy_directories = copy_directories
        self._refcounts: dict[Path, int] = {}
        self._lock = threading.Lock()
        if root is not None and root.exists():
            for stale in root.glob(_STAGING_PREFIX + "*"):
                logger.warning("removing leftover staging folder %s", stale)
                shutil.rmtree(stale, ignore_errors=True)

    @property
    def root(self) -> Path:
        """The store folder (created on first use; a temporary folder when none was given)."""
        with self._lock:
            if self._root is None:
                self._root = Path(tempfile.mkdtemp(prefix="loraplex-adapters-"))
                self._created_root = True
            self._root.mkdir(parents=True, exist_ok=True)
            return self._root

    @property
    def owned_folders(self) -> dict[Path, int]:
        """Folders this store owns, with how many registered adapters use each."""
        with self._lock:
            return dict(self._refcounts)

    def stage(self, source: Path, spec: BaseModelSpec, max_rank: int, dtype: torch.dtype) -> StagedAdapter:
        """Validate the adapter at ``source`` (folder or archive) and place it in the store."""
        if not source.exists():
            raise AdapterValidationError("not_found", f"{source}: no such file or folder")
        if source.is_dir() and not self._copy_directories:
            return StagedAdapter(source, False, read_adapter(source, spec, max_rank, dtype))
        if not source.is_dir() and not is_archive(source):
            raise AdapterValidationError(
                "pickle_format"
                if source.suffix.lower() in (".bin", ".pt", ".pth", ".pkl")
                else "bad_archive",
                f"{source}: expected a PEFT adapter folder or a .zip/.tar.gz of one",
            )
        staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=self.root))
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
            return StagedAdapter(self._publish(staging, parsed.version), True, parsed)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def _publish(self, staging: Path, version: str) -> Path:
        final = staging.parent / version
        with self._lock:
            if final.exists():
                shutil.rmtree(staging)  # same content is already stored
            else:
                os.chmod(staging, 0o755)
                staging.rename(final)
            self._refcounts[final] = self._refcounts.get(final, 0) + 1
        return final

    def load(
        self, staged_folder: Path, spec: BaseModelSpec, max_rank: int, dtype: torch.dtype, version: str
    ) -> ParsedAdapter:
        """Re-read a staged adapter (host-cache miss), checking it still is ``version``."""
        return read_adapter(staged_folder, spec, max_rank, dtype, expected_version=version)

    def release(self, folder: Path) -> None:
        """Drop one user of an owned folder; delete it when none is left."""
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
        """Delete every owned folder (and the root, if this store created it)."""
        with self._lock:
            folders, self._refcounts = list(self._refcounts), {}
            root, created = self._root, self._created_root
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        if root is not None and created:
            shutil.rmtree(root, ignore_errors=True)
