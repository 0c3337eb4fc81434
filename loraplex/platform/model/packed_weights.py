"""Projection weights kept in a block format (``PackedWeight``): read from a GGUF file as they
are stored there, or quantized to per-channel int8 at load time.

``quantization`` (``EngineConfig``):

| value | projections and LM head | embedding |
|---|---|---|
| ``none`` | floats in ``dtype`` (HF-exact path) | floats |
| ``gguf`` | the file's own blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, F16, BF16) | its blocks, rows decoded |
| ``int8`` | per-channel int8 made from the floats | floats |

``auto`` is ``gguf`` for a GGUF model and ``none`` otherwise. Norms stay float (they are
float32 in GGUF files too).

GGUF's llama files store q and k with each head's rows interleaved for its rotary
(llama.cpp's ``permute``); transformers undoes it when it de-quantises, and so do we, on
the packed rows (a row's blocks move together), so the packed weights dequantize to
exactly the floats of the converted HF directory that the fidelity tests load into HF.
A fused projection whose parts are stored in different formats (a Q4_K_M file's q/k in
Q4_K and v in Q6_K) is kept as float32 rows (``f32``): exact, at 8x the bytes of that part.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from loraplex.kernels.contracts import PackedWeight, WeightFormatName
from loraplex.kernels.formats import FORMATS
from loraplex.platform.model.arch import ModelArch

logger = logging.getLogger(__name__)

QUANTIZATIONS: tuple[str, ...] = ("auto", "none", "gguf", "int8")  # EngineConfig.quantization

# GGML tensor type name -> our format
_GGML_FORMATS: dict[str, WeightFormatName] = {
    "F32": "f32",
    "F16": "f16",
    "BF16": "bf16",
    "Q8_0": "q8_0",
    "Q4_0": "q4_0",
    "Q4_1": "q4_1",
    "Q4_K": "q4_k",
    "Q6_K": "q6_k",
}
# our fused projection -> its GGUF tensors, in the fused row order
_FUSED = {
    "qkv_weight": ("attn_q", "attn_k", "attn_v"),
    "o_weight": ("attn_output",),
    "gate_up_weight": ("ffn_gate", "ffn_up"),
    "down_weight": ("ffn_down",),
}
# the same, as the HF checkpoint names them (what the float loader then skips)
HF_NAMES = {
    "qkv_weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_weight": ("self_attn.o_proj.weight",),
    "gate_up_weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_weight": ("mlp.down_proj.weight",),
}
_PERMUTED_ARCHS = ("llama",)  # llama.cpp's converter permutes q/k rows for these


def resolve_quantization(setting: str, gguf_path: Path | None) -> Literal["none", "gguf", "int8"]:
    """What ``setting`` means for a model from ``gguf_path`` (None: a Hugging Face directory)."""
    if setting == "auto":
        return "gguf" if gguf_path is not None else "none"
    if setting == "gguf" and gguf_path is None:
        raise ValueError(
            "quantization='gguf' keeps a GGUF file's blocks: the model is a Hugging Face directory "
            "(use quantization='int8' or 'none', or pass the .gguf file as the model)"
        )
    if setting not in ("none", "gguf", "int8"):
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {setting!r}")
    return setting  # type: ignore[return-value]


def _unpermute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary interleave of q / k rows (transformers' ``_reverse_permute_weights``)."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, rows.shape[1]).swapaxes(1, 2).reshape(rows.shape)


def _read_tensor(tensor: object) -> tuple[WeightFormatName, np.ndarray, int]:
    """(format, [rows, row_bytes] uint8, in_features) of one 2-D GGUF tensor."""
    kind = tensor.tensor_type.name  # type: ignore[attr-defined]
    if kind not in _GGML_FORMATS:
        raise ValueError(
            f"GGUF tensor {tensor.name} is {kind}, which quantization='gguf' does not keep "  # type: ignore[attr-defined]
            f"(kept: {', '.join(_GGML_FORMATS)}); use quantization='none' to de-quantise it"
        )
    in_features, rows = (int(d) for d in tensor.shape)  # type: ignore[attr-defined]
    data = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)  # type: ignore[attr-defined]
    return _GGML_FORMATS[kind], data, in_features


def _as_f32_rows(fmt: WeightFormatName, data: np.ndarray, in_features: int) -> np.ndarray:
    floats = FORMATS[fmt].dequantize(torch.from_numpy(np.ascontiguousarray(data)), in_features)
    return floats.contiguous().view(torch.uint8).numpy()


def read_gguf_weights(gguf_path: Path, arch: ModelArch) -> dict[str, PackedWeight]:
    """The projections, embedding and LM head of ``gguf_path`` as packed weights, by our names
    (``layers.{i}.qkv_weight``, ..., ``embed``, ``lm_head``)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    field = reader.fields.get("general.architecture")
    gguf_arch = bytes(field.parts[-1]).decode() if field is not None else ""
    permute = gguf_arch in _PERMUTED_ARCHS
    out: dict[str, PackedWeight] = {}

    def pack(key: str, names: tuple[str, ...]) -> None:
        parts = []
        for name in names:
            if name not in tensors:
                raise KeyError(f"GGUF tensor {name!r} missing from {gguf_path}")
            fmt, data, in_features = _read_tensor(tensors[name])
            if permute and name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = arch.num_heads if name.endswith("attn_q.weight") else arch.num_kv_heads
                data = _unpermute(data, heads)
            parts.append((fmt, data, in_features))
        formats = {fmt for fmt, _, _ in parts}
        in_features = parts[0][2]
        if len(formats) > 1:
            parts = [("f32", _as_f32_rows(fmt, data, k), k) for fmt, data, k in parts]
            formats = {"f32"}
        fmt = formats.pop()
        rows = np.concatenate([data for _, data, _ in parts]) if len(parts) > 1 else parts[0][1]
        out[key] = PackedWeight(FORMATS[fmt], torch.from_numpy(np.array(rows, copy=True)), in_features)

    for i in range(arch.num_layers):
        for ours, names in _FUSED.items():
            pack(f"layers.{i}.{ours}", tuple(f"blk.{i}.{n}.weight" for n in names))
    pack("embed", ("token_embd.weight",))
    if not arch.tie_word_embeddings and "output.weight" in tensors:
        pack("lm_head", ("output.weight",))
    return out


def quantize_int8(weight: torch.Tensor) -> PackedWeight:
    """Per-channel int8 of a float ``[out, in]`` weight (``formats/int8.py``)."""
    fmt = FORMATS["int8"]
    return PackedWeight(fmt, fmt.quantize(weight.float().cpu()).to(weight.device), int(weight.shape[1]))


def describe(packed: dict[str, PackedWeight]) -> str:
    """``q4_1 x210, q8_0 x1: 94.1 MB`` for the start-up log."""
    counts = Counter(p.format.name for p in packed.values())
    total = sum(p.nbytes for p in packed.values())
    kinds = ", ".join(f"{name} x{n}" for name, n in counts.most_common())
    return f"{kinds}: {total / 1e6:.1f} MB"
