"""Uploaded adapters: the files of one upload, checked against the base model before they are stored.

Protocol of one upload (the gateway's ``AdapterCatalog``, the operators' CLI)::

    staging = store.new_staging()                  # inside the store: nothing is written anywhere else
    facts = validator.validate(upload, staging)    # extract / check in staging (a worker thread)
    store.publish(facts.folder, facts.version)     # rename into root/<version> (same content: already there)
    ... commit the database row ...
    store.discard(staging)                         # always, in a finally

Archives are extracted by ``loraplex.adapters.archive`` (every member checked before a byte is
written) with limits derived from the base model: no valid adapter is larger than
``BaseModelSpec.max_adapter_bytes(max_lora_rank)``, so an archive bomb stops at that size.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.adapters.archive import ArchiveLimits, extract_adapter_archive
from loraplex.adapters.errors import AdapterValidationError
from loraplex.adapters.layout import CONFIG_NAME, PICKLE_SUFFIXES, WEIGHTS_NAME
from loraplex.adapters.loader import MAX_CONFIG_BYTES, parse_adapter, read_adapter_files
from loraplex.adapters.spec import BaseModelSpec, ModuleName

logger = logging.getLogger(__name__)

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")

# First bytes of the archive formats ``extract_adapter_archive`` reads, and the suffix it needs.
_MAGIC: tuple[tuple[int, bytes, str], ...] = (
    (0, b"PK\x03\x04", ".zip"),
    (0, b"PK\x05\x06", ".zip"),  # an empty zip: refused later with a clear reason
    (0, b"\x1f\x8b", ".tar.gz"),
    (0, b"BZh", ".tar.bz2"),
    (0, b"\xfd7zXZ\x00", ".tar.xz"),
    (257, b"ustar", ".tar"),
)


@dataclass(frozen=True)
class UploadedFile:
    """One file part of an upload, written into the staging folder."""

    field: str
    filename: str
    """As the client named it (only used to recognise pickles and in messages)."""
    path: Path
    num_bytes: int


@dataclass(frozen=True)
class AdapterFacts:
    """What validation learnt about an upload, and where its two files wait in staging."""

    folder: Path
    version: str
    rank: int
    target_modules: tuple[ModuleName, ...]
    nbytes: int
    """Bytes stored: the config plus the safetensors weights."""


class AdapterValidator:
    """Checks uploads against one base model, with the engine's ``max_lora_rank`` and dtype."""

    def __init__(self, spec: BaseModelSpec, max_rank: int, dtype: torch.dtype) -> None:
        self.spec = spec
        self.max_rank = max_rank
        self.dtype = dtype
        max_weights = spec.max_adapter_bytes(max_rank)
        self.archive_limits = ArchiveLimits(
            max_members=64,
            max_member_bytes=max_weights,
            max_total_bytes=max_weights + MAX_CONFIG_BYTES + (1 << 20),
        )

    @property
    def max_upload_bytes(self) -> int:
        """The largest upload that can hold a valid adapter: the archive limit, plus its headers."""
        return self.archive_limits.max_total_bytes + self.archive_limits.max_members * 1024

    def validate(self, files: dict[str, UploadedFile], staging: Path) -> AdapterFacts:
        """Check an upload (``file``, or ``adapter_config`` + ``adapter_model``) against the base
        model; its two files end up in ``staging/adapter``. ``AdapterValidationError`` otherwise."""
        folder = staging / "adapter"
        folder.mkdir()
        archive = files.get("file")
        if archive is not None:
            extract_adapter_archive(_named_archive(archive), folder, self.archive_limits)
        else:
            config, weights = files.get("adapter_config"), files.get("adapter_model")
            if config is None or weights is None:
                raise AdapterValidationError(
                    "missing_weights" if config is not None else "missing_config",
                    "send the adapter as 'file' (a .zip or .tar.gz of the PEFT folder), or as the two "
                    "files 'adapter_config' and 'adapter_model'",
                )
            _refuse_pickle(weights)
            config.path.rename(folder / CONFIG_NAME)
            weights.path.rename(folder / WEIGHTS_NAME)
        adapter_files = read_adapter_files(folder, self.spec, self.max_rank)
        parsed = parse_adapter(adapter_files, self.spec, self.max_rank, self.dtype, "upload")
        return AdapterFacts(
            folder=folder,
            version=parsed.version,
            rank=parsed.weights.max_rank,
            target_modules=parsed.weights.target_modules,
            nbytes=len(parsed.files.config) + len(parsed.files.weights),
        )


def _refuse_pickle(weights: UploadedFile) -> None:
    if weights.filename.lower().endswith(PICKLE_SUFFIXES):
        raise AdapterValidationError(
            "pickle_format",
            f"{weights.filename}: pickle weights are never loaded (they can run code); "
            f"re-save with safe_serialization=True to get {WEIGHTS_NAME}",
        )


def _named_archive(upload: UploadedFile) -> Path:
    """The uploaded archive renamed with the suffix of its real format (read from its first bytes),
    which is what ``extract_adapter_archive`` dispatches on."""
    with upload.path.open("rb") as fh:
        head = fh.read(512)
    suffix = next((s for at, magic, s in _MAGIC if head[at : at + len(magic)] == magic), None)
    if suffix is None:
        if upload.filename.lower().endswith(PICKLE_SUFFIXES) or head[:1] == b"\x80":
            raise AdapterValidationError(
                "pickle_format",
                f"{upload.filename}: a pickle file is never loaded (it can run code); upload a .zip or "
                f".tar.gz of the adapter folder holding {WEIGHTS_NAME}",
            )
        raise AdapterValidationError(
            "bad_archive", f"{upload.filename}: not a .zip or .tar(.gz|.bz2|.xz) archive"
        )
    stem = _SAFE_NAME.sub("_", Path(upload.filename).name).split(".")[0][:64] or "upload"
    named = upload.path.with_name(stem + suffix)
    upload.path.rename(named)
    return named
