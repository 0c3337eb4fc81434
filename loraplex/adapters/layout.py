"""Which files of a PEFT adapter folder the engine reads, and which it refuses."""

from __future__ import annotations

from collections.abc import Iterable

from loraplex.adapters.errors import AdapterValidationError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# Weight formats that unpickle on load, i.e. can run arbitrary code: never opened.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def check_file_names(names: Iterable[str], source: str) -> None:
    """Raise unless ``names`` (the files in one adapter folder) hold the config and safetensors weights.

    A folder with only pickled weights is refused with ``pickle_format``; when the
    safetensors file is present, pickles beside it are ignored (never read).
    """
    present = set(names)
    if CONFIG_NAME not in present:
        raise AdapterValidationError("missing_config", f"{source}: no {CONFIG_NAME}")
    if WEIGHTS_NAME in present:
        return
    pickles = sorted(n for n in present if n.lower().endswith(PICKLE_SUFFIXES))
    if pickles:
        raise AdapterValidationError(
            "pickle_format",
            f"{source}: weights {pickles} are pickle files, which are never loaded (they can run code); "
            f"re-save with safe_serialization=True to get {WEIGHTS_NAME}",
        )
    raise AdapterValidationError("missing_weights", f"{source}: no {WEIGHTS_NAME}")
