"""The model families we serve, as data: what each one's decoder layer has that Llama's has not.

Every family runs the one forward in ``llama.py``; a ``Family`` says which of its optional
parts a model type uses. ``ModelArch.from_hf_config`` reads the numbers (window, soft-cap
values, RoPE bases, ...) from the HF config and the family's switches from here. Adding a
family is one entry below, when its parts are among these (docs/architecture.md,
"Adding a model family"); a part the forward lacks is one switch here plus its few lines
in ``llama.py`` (and ``loader.py`` if the checkpoint names differ).

Module names are the HF checkpoint's (and PEFT's ``target_modules``): the fused projections
``qkv`` and ``gate_up`` are made from ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``,
or read whole where the checkpoint stores them fused (Phi-3's ``qkv_proj``, ``gate_up_proj``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Activation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class Family:
    """One model family's switches (the numbers come from each model's config)."""

    model_types: tuple[str, ...]  # HF ``model_type`` values served as this family
    qkv_bias: bool = False  # q/k/v projections have biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    gemma_norms: bool = False  # RMSNorm scales by (1 + w); norms before and after attention and MLP
    embed_scale: bool = False  # the embedding is multiplied by sqrt(hidden_size) (Gemma)
    query_pre_attn_scalar: bool = False  # attention scale = query_pre_attn_scalar ** -0.5 (Gemma)
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)
    default_act: Activation = "silu"
    # Which layers use the sliding window when the config has no ``layer_types``:
    # "all" (Mistral, Phi-3), "from_max_window_layers" (Qwen2/3 with use_sliding_window).
    window_layers: Literal["all", "from_max_window_layers", "layer_types"] = "all"


FAMILIES: dict[str, Family] = {
    "llama": Family(model_types=("llama",)),
    "mistral": Family(model_types=("mistral",)),
    "qwen2": Family(model_types=("qwen2",), qkv_bias=True, window_layers="from_max_window_layers"),
    "qwen3": Family(model_types=("qwen3",), qk_norm=True, window_layers="from_max_window_layers"),
    "gemma2": Family(
        model_types=("gemma2",),
        gemma_norms=True,
        embed_scale=True,
        query_pre_attn_scalar=True,
        default_act="gelu_tanh",
        window_layers="layer_types",
    ),
    "gemma3": Family(
        model_types=("gemma3_text",),
        qk_norm=True,
        gemma_norms=True,
        embed_scale=True,
        query_pre_attn_scalar=True,
        default_act="gelu_tanh",
        window_layers="layer_types",
    ),
    "phi3": Family(model_types=("phi3",), fused_checkpoint=True),
}

FAMILY_OF_MODEL_TYPE: dict[str, str] = {t: name for name, f in FAMILIES.items() for t in f.model_types}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILY_OF_MODEL_TYPE)

# HF activation names -> ours
ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
}
