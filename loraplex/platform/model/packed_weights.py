"""Projection weights kept in a block format (``PackedWeight``): read from a GGUF file as they
are stored there, or quantized to per-channel int8 at load time.

``quantization`` (``EngineConfig``):

| value | projections and LM head | embedding |
|---|---|---|
| ``none`` | floats in ``dtype`` (HF-exact path) | floats |
| ``gguf`` | the file's own blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, F16, BF16) | its blocks, rows decoded |
| ``gguf_a8`` | as ``gguf``; int8 activations at decode steps (llama.cpp's arithmetic) | as ``gguf`` |
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

import ctypes
import ctypes.util
import gc
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

QUANTIZATIONS: tuple[str, ...] = ("auto", "none", "gguf", "gguf_a8", "int8")  # EngineConfig.quantization

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
# architectures whose GGUF files keep a fused projection whole (llama.cpp's names)
_FUSED_BY_ARCH: dict[str, dict[str, tuple[str, ...]]] = {
    "phi3": {"qkv_weight": ("attn_qkv",), "gate_up_weight": ("ffn_up",)},  # rows q|k|v, gate|up
}
# the same, as the HF checkpoint names them (what the float loader then skips)
HF_NAMES = {
    "qkv_weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_weight": ("self_attn.o_proj.weight",),
    "gate_up_weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_weight": ("mlp.down_proj.weight",),
}
_PERMUTED_ARCHS = ("llama",)  # llama.cpp's converter permutes q/k rows for these


def resolve_quantization(setting: str, gguf_path: Path | None) -> Literal["none", "gguf", "gguf_a8", "int8"]:
    """What ``setting`` means for a model from ``gguf_path`` (None: a Hugging Face directory)."""
    if setting == "auto":
        return "gguf" if gguf_path is not None else "none"
    if setting in ("gguf", "gguf_a8") and gguf_path is None:
        raise ValueError(
            f"quantization={setting!r} keeps a GGUF file's blocks: the model is a Hugging Face directory "
            "(use quantization='int8' or 'none', or pass the .gguf file as the model)"
        )
    if setting not in ("none", "gguf", "gguf_a8", "int8"):
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {setting!r}")
    return setting  # type: ignore[return-value]


def _copy_rows(target: np.ndarray, rows: np.ndarray, unpermute_heads: int) -> None:
    """``target[...] = rows``, undoing llama.cpp's rotary interleave of q / k rows when
    ``unpermute_heads`` (transformers' ``_reverse_permute_weights``), with no temporary: the
    file's pages are read once, straight into the weight's own memory."""
    if not unpermute_heads:
        target[...] = rows
        return
    half = rows.shape[0] // unpermute_heads // 2
    shape = (unpermute_heads, 2, half, rows.shape[1])
    target.reshape(shape)[...] = rows.reshape(unpermute_heads, half, 2, rows.shape[1]).swapaxes(1, 2)


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

    def heads(name: str) -> int:
        if permute and name.endswith("attn_q.weight"):
            return arch.num_heads
        return arch.num_kv_heads if permute and name.endswith("attn_k.weight") else 0

    def pack(key: str, names: tuple[str, ...]) -> None:
        parts = []
        for name in names:
            if name not in tensors:
                raise KeyError(f"GGUF tensor {name!r} missing from {gguf_path}")
            parts.append((*_read_tensor(tensors[name]), heads(name)))
        formats = {fmt for fmt, _, _, _ in parts}
        in_features = parts[0][2]
        if len(formats) > 1:
            parts = [("f32", _as_f32_rows(fmt, data, k), k, h) for fmt, data, k, h in parts]
            formats = {"f32"}
        fmt = formats.pop()
        # One allocation per weight, filled from the mapped file (no concatenated temporaries:
        # freed copies stayed in the heap and doubled the resident bytes of a load).
        data = torch.empty(sum(p[1].shape[0] for p in parts), parts[0][1].shape[1], dtype=torch.uint8)
        start = 0
        for _, rows, _, unpermute_heads in parts:
            _copy_rows(data.numpy()[start : start + rows.shape[0]], rows, unpermute_heads)
            start += rows.shape[0]
        out[key] = PackedWeight(FORMATS[fmt], data, in_features)

    fused = {**_FUSED, **_FUSED_BY_ARCH.get(gguf_arch, {})}
    for i in range(arch.num_layers):
        for ours, names in fused.items():
            pack(f"layers.{i}.{ours}", tuple(f"blk.{i}.{n}.weight" for n in names))
    pack("embed", ("token_embd.weight",))
    if not arch.tie_word_embeddings and "output.weight" in tensors:
        pack("lm_head", ("output.weight",))
    tensors.clear()  # the reader and its memory map go with the last reference
    del reader
    _release_free_heap()
    return out


def _release_free_heap() -> None:
    """Hand the heap the GGUF reader freed back to the OS (glibc ``malloc_trim``): its parse of
    the file's metadata (a 49k-token vocabulary as numpy pieces) left ~32 MB of free heap in
    the process, a third of SmolLM2's packed weights, which the engine's malloc tuning would
    otherwise keep resident. No-op off glibc."""
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


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
