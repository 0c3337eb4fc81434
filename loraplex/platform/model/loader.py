"""Load weights from a local Hugging Face directory (safetensors) into our model.

Separate q/k/v and gate/up matrices are concatenated into the fused layout the
forward uses. Pickle checkpoints (``.bin``/``.pt``) are refused: loading them can
run arbitrary code. With a quantization (``packed_weights.py``) the projections come
packed (from the GGUF file, or int8 from the floats) and their floats are never kept.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from loraplex.kernels.contracts import LinearBackend, PackedWeight, PointwiseBackend
from loraplex.kernels.rotary_layout import rotary_head_order, rotary_row_order
from loraplex.platform.model.arch import ModelArch
from loraplex.platform.model.llama import PROJECTIONS, LlamaForCausalLM
from loraplex.platform.model.packed_weights import HF_NAMES, describe, quantize_int8, read_gguf_weights

logger = logging.getLogger(__name__)


def load_hf_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in model_dir.glob("*.bin")] + [p.name for p in model_dir.glob("*.pt")]
        hint = (
            f" (found pickle files {pickles}, which are refused: convert them to safetensors)"
            if pickles
            else ""
        )
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}{hint}")
    return files


def _read_state_dict(model_dir: Path, skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every tensor but those named in ``skip`` (with or without the ``model.`` prefix): a
    packed weight's floats are never read, so they never take memory."""
    state: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name in skip or name.removeprefix("model.") in skip:
                    continue
                state[name] = fh.get_tensor(name)
    return state


# Checkpoints that store the fused projections whole (Phi-3): our name -> theirs.
FUSED_HF_NAMES = {
    "qkv_weight": ("self_attn.qkv_proj.weight",),
    "gate_up_weight": ("mlp.gate_up_proj.weight",),
}


def _hf_names(key: str, arch: ModelArch) -> tuple[str, ...]:
    """The HF checkpoint tensors our weight ``key`` is made from."""
    if key == "embed":
        return ("embed_tokens.weight",)
    if key == "lm_head":
        return ("lm_head.weight",)
    layer, name = key.rsplit(".", 1)
    if arch.fused_checkpoint and name in FUSED_HF_NAMES:
        return tuple(f"{layer}.{hf}" for hf in FUSED_HF_NAMES[name])
    return tuple(f"{layer}.{hf}" for hf in HF_NAMES[name])


def qk_row_order(arch: ModelArch) -> torch.Tensor:
    """The fused q|k|v rows in the order the forward keeps them: q and k heads in
    ``kernels.rotary_layout``'s order (a partial rotary), v as the checkpoint has it."""
    assert arch.rotary_dim is not None
    q = rotary_row_order(arch.num_heads, arch.head_dim, arch.rotary_dim)
    k = rotary_row_order(arch.num_kv_heads, arch.head_dim, arch.rotary_dim)
    v = range(arch.q_size + arch.kv_size, arch.q_size + 2 * arch.kv_size)
    return torch.tensor([*q, *(arch.q_size + i for i in k), *v])


def _store_rotary_order(
    arch: ModelArch, weights: dict[str, torch.Tensor], packed: dict[str, PackedWeight]
) -> None:
    """Reorder the q and k rows of every layer's fused projection (and bias, and per-head q/k
    norms) so the whole-head rotary kernels turn only the rotary part (a partial rotary)."""
    assert arch.rotary_dim is not None
    order = qk_row_order(arch)
    head = torch.tensor(rotary_head_order(arch.head_dim, arch.rotary_dim))
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        if p + "qkv_weight" in packed:  # GGUF blocks run along a row: whole rows move
            w = packed[p + "qkv_weight"]
            packed[p + "qkv_weight"] = PackedWeight(w.format, w.data[order].contiguous(), w.in_features)
        else:
            weights[p + "qkv_weight"] = weights[p + "qkv_weight"][order].contiguous()
        if p + "qkv_bias" in weights:
            weights[p + "qkv_bias"] = weights[p + "qkv_bias"][order].contiguous()
        for norm in ("q_norm", "k_norm"):
            if p + norm in weights:
                weights[p + norm] = weights[p + norm][head].contiguous()


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    linear: LinearBackend | None = None,
    pointwise: PointwiseBackend | None = None,
    quantization: str = "none",
    gguf_path: Path | None = None,
) -> tuple[LlamaForCausalLM, ModelArch, Any]:
    """Build our model for ``model_dir`` and fill it with its weights (cast to ``dtype``);
    ``linear`` computes its projections (torch's ``F.linear`` when None), ``pointwise``
    its norms, rotary embedding and activation (torch ops when None). ``quantization``
    ("none", "gguf" or "gguf_a8" with ``gguf_path``, "int8") keeps the projections packed."""
    hf_config = load_hf_config(model_dir)
    arch = ModelArch.from_hf_config(hf_config)
    packed: dict[str, PackedWeight] = {}
    if quantization in ("gguf", "gguf_a8"):
        if gguf_path is None:
            raise ValueError("quantization='gguf' needs the model's .gguf file")
        packed = read_gguf_weights(gguf_path, arch)
    skip = frozenset(name for key in packed for name in _hf_names(key, arch))
    state = _read_state_dict(model_dir, skip)
    prefix = "model." if any(k.startswith("model.") for k in state) else ""

    def take(name: str) -> torch.Tensor:
        key = prefix + name
        if key not in state:
            raise KeyError(f"weight {key!r} missing from {model_dir}")
        return state.pop(key).to(dtype)

    def norm(name: str) -> torch.Tensor:
        # Gemma's RMSNorm scales by (1 + w): folded into the weight once, in float32 as HF
        # computes it, so the forward's norms are all w * x / rms(x).
        if arch.gemma_norms:
            key = prefix + name
            if key not in state:
                raise KeyError(f"weight {key!r} missing from {model_dir}")
            return (state.pop(key).float() + 1.0).to(dtype)
        return take(name)

    weights: dict[str, torch.Tensor] = {"norm": norm("norm.weight")}
    if "embed" not in packed:
        weights["embed"] = take("embed_tokens.weight")
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        weights[p + "input_norm"] = norm(p + "input_layernorm.weight")
        if arch.gemma_norms:
            weights[p + "attn_out_norm"] = norm(p + "post_attention_layernorm.weight")
            weights[p + "post_norm"] = norm(p + "pre_feedforward_layernorm.weight")
            weights[p + "mlp_out_norm"] = norm(p + "post_feedforward_layernorm.weight")
        else:
            weights[p + "post_norm"] = take(p + "post_attention_layernorm.weight")
        if arch.qk_norm:
            weights[p + "q_norm"] = norm(p + "self_attn.q_norm.weight")
            weights[p + "k_norm"] = norm(p + "self_attn.k_norm.weight")
        if p + "qkv_weight" not in packed and arch.fused_checkpoint:
            weights[p + "qkv_weight"] = take(p + "self_attn.qkv_proj.weight")  # rows q | k | v
        elif p + "qkv_weight" not in packed:
            weights[p + "qkv_weight"] = torch.cat(
                [take(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")], dim=0
            )
        if arch.qkv_bias:
            weights[p + "qkv_bias"] = torch.cat(
                [take(p + f"self_attn.{n}_proj.bias") for n in ("q", "k", "v")]
            )
        if p + "o_weight" not in packed:
            weights[p + "o_weight"] = take(p + "self_attn.o_proj.weight")
        if arch.o_bias:
            weights[p + "o_bias"] = take(p + "self_attn.o_proj.bias")
        if p + "gate_up_weight" not in packed and arch.fused_checkpoint:
            weights[p + "gate_up_weight"] = take(p + "mlp.gate_up_proj.weight")  # rows gate | up
        elif p + "gate_up_weight" not in packed:
            weights[p + "gate_up_weight"] = torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0
            )
        if p + "down_weight" not in packed:
            weights[p + "down_weight"] = take(p + "mlp.down_proj.weight")
        if arch.mlp_bias:
            weights[p + "gate_up_bias"] = torch.cat(
                [take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")]
            )
            weights[p + "down_bias"] = take(p + "mlp.down_proj.bias")
    if not arch.tie_word_embeddings and "lm_head" not in packed:
        weights["lm_head"] = state.pop("lm_head.weight").to(dtype)
    state.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    if arch.rotary_dim is not None:
        _store_rotary_order(arch, weights, packed)
    if quantization == "int8":
        for key in [k for k in weights if k.rsplit(".", 1)[-1] in {f"{n}_weight" for n in PROJECTIONS}]:
            packed[key] = quantize_int8(weights.pop(key))
        if "lm_head" in weights:
            packed["lm_head"] = quantize_int8(weights.pop("lm_head"))
        else:  # tied: the lookup keeps the float table, the LM head reads an int8 copy
            packed["logits"] = quantize_int8(weights["embed"])
    leftover = [k for k in state if "rotary_emb" not in k]
    if leftover:
        logger.warning("ignoring %d unused weights, e.g. %s", len(leftover), leftover[:3])

    with torch.device(device):
        model = LlamaForCausalLM(arch, dtype, max_positions=max_positions)
    for key, weight in packed.items():
        model.set_packed(key, weight.to(device))
    if packed:
        logger.info("%s weights kept packed: %s", quantization, describe(packed))
    # assign=True adopts the loaded tensors instead of copying into fresh ones.
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if missing or unexpected:
        raise KeyError(f"weights do not fit the model: missing {missing}, unexpected {list(unexpected)}")
    model.eval()
    if linear is not None:
        model.use_linear(linear, int8_activations=quantization == "gguf_a8")
    if pointwise is not None:
        model.use_pointwise(pointwise)
    return model, arch, hf_config
