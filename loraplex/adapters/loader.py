"""Read a PEFT adapter folder, validate it against the base model, compute its version.

The files are read once into memory and everything (hash, JSON, safetensors) is
parsed from those bytes, so what was validated is exactly what gets hashed and
stored, even if someone rewrites the folder meanwhile. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.adapters.errors import AdapterValidationError
from loraplex.adapters.identity import content_version
from loraplex.adapters.layout import CONFIG_NAME, WEIGHTS_NAME, check_file_names
from loraplex.adapters.peft_config import LoraSettings, parse_lora_config
from loraplex.adapters.peft_weights import AdapterWeights, load_weights
from loraplex.adapters.spec import BaseModelSpec

logger = logging.getLogger(__name__)

MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class AdapterFiles:
    """The raw bytes of an adapter's two files."""

    config: bytes
    weights: bytes


@dataclass(frozen=True)
class ParsedAdapter:
    """A validated adapter: its settings, its scaled weights (host, serving dtype), its version."""

    settings: LoraSettings
    weights: AdapterWeights
    version: str
    files: AdapterFiles


def _read_limited(path: Path, max_bytes: int, source: str) -> bytes:
    size = path.stat().st_size
    if size > max_bytes:
        raise AdapterValidationError(
            "too_large",
            f"{source}: {path.name} is {size} bytes; no valid adapter for this base model "
            f"and max_lora_rank is larger than {max_bytes} bytes",
        )
    with path.open("rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew after stat()
        raise AdapterValidationError("too_large", f"{source}: {path.name} is over {max_bytes} bytes")
    return data


def read_adapter_files(folder: Path, spec: BaseModelSpec, max_rank: int) -> AdapterFiles:
    """Read ``adapter_config.json`` and ``adapter_model.safetensors`` from ``folder``."""
    source = str(folder)
    if not folder.exists():
        raise AdapterValidationError("not_found", f"{source}: no such file or folder")
    if not folder.is_dir():
        raise AdapterValidationError("bad_archive", f"{source}: not a folder or a .zip/.tar.gz archive")
    names = [p.name for p in folder.iterdir() if p.is_file()]
    check_file_names(names, source)
    try:
        return AdapterFiles(
            config=_read_limited(folder / CONFIG_NAME, MAX_CONFIG_BYTES, source),
            weights=_read_limited(folder / WEIGHTS_NAME, spec.max_adapter_bytes(max_rank), source),
        )
    except OSError as exc:
        raise AdapterValidationError("not_found", f"{source}: cannot read the adapter files ({exc})") from exc


def parse_adapter(
    files: AdapterFiles,
    spec: BaseModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    source: str,
    check_values: bool = True,
) -> ParsedAdapter:
    """Validate both files against ``spec``; the weights come back scaled, in ``dtype``.
    ``check_values``: see ``parse_weights`` (False only for bytes validated before)."""
    settings = parse_lora_config(files.config, f"{source}/{CONFIG_NAME}")
    weights = load_weights(
        files.weights, settings, spec, max_rank, dtype, f"{source}/{WEIGHTS_NAME}", check_values
    )
    version = content_version(json.loads(files.config), files.weights)
    logger.debug(
        "validated adapter %s: %d modules, max rank %d, version %s",
        source,
        len(weights.modules),
        weights.max_rank,
        version[:12],
    )
    return ParsedAdapter(settings, weights, version, files)


def read_adapter(
    folder: Path,
    spec: BaseModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    expected_version: str | None = None,
) -> ParsedAdapter:
    """``read_adapter_files`` then ``parse_adapter``; check the version when one is expected."""
    parsed = parse_adapter(read_adapter_files(folder, spec, max_rank), spec, max_rank, dtype, str(folder))
    if expected_version is not None and parsed.version != expected_version:
        raise AdapterValidationError(
            "changed_on_disk",
            f"{folder}: content is version {parsed.version[:12]}, registered as {expected_version[:12]}; "
            "re-add the adapter to serve the new files",
        )
    return parsed


def reread_adapter(
    folder: Path, spec: BaseModelSpec, max_rank: int, dtype: torch.dtype, version: str
) -> ParsedAdapter:
    """Read back an adapter registered as ``version`` (a host-cache miss).

    The content hash is checked *before* parsing: bytes that hash to ``version`` are the
    bytes whose values were validated at registration, so the value checks (a few
    milliseconds of tensor passes per adapter, on the loader thread beside the engine) are
    not repeated. Anything else is ``changed_on_disk``.
    """
    files = read_adapter_files(folder, spec, max_rank)
    try:
        found = content_version(json.loads(files.config), files.weights)
    except ValueError as exc:  # not JSON any more: certainly not the registered content
        raise AdapterValidationError(
            "changed_on_disk", f"{folder}: {CONFIG_NAME} is no longer valid JSON ({exc})"
        ) from exc
    if found != version:
        raise AdapterValidationError(
            "changed_on_disk",
            f"{folder}: content is version {found[:12]}, registered as {version[:12]}; "
            "re-add the adapter to serve the new files",
        )
    return parse_adapter(files, spec, max_rank, dtype, str(folder), check_values=False)
