"""The architecture of the model we serve, read from a HF config: shapes, constants and the
family's parts (``families.py``).

Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3 (text), Phi-3 and SmolLM2 share one
forward: RMSNorm, RoPE (default, linear, Llama-3, YaRN or LongRoPE scaling, one base per
layer type), grouped-query attention with an optional per-layer sliding window and logit
soft-capping, a gated MLP (SiLU or GeLU-tanh), optionally tied embeddings, q/k/v bias,
q/k norm, Gemma's (1 + w) norms around attention and MLP and its embedding scale.
Anything else is refused with a reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.kernels.rotary_layout import rotary_head_order
from loraplex.platform.model.families import (
    ACTIVATIONS,
    FAMILIES,
    FAMILY_OF_MODEL_TYPE,
    SUPPORTED_MODEL_TYPES,
)

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelArch", "RopeSpec", "rope_inv_freq"]


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: a base and its scaling, or frequencies transformers computed for us.

    ``inv_freq`` (YaRN, LongRoPE) comes from ``transformers.modeling_rope_utils`` so the
    frequencies are HF's own; LongRoPE's ``long_inv_freq`` serves positions from
    ``long_from`` on (HF switches the whole batch to it once a sequence passes the
    pretraining length; positions below that length are exact). ``attention_factor``
    multiplies cos and sin (YaRN, LongRoPE).
    """

    theta: float
    scaling: dict[str, Any] | None = None
    inv_freq: tuple[float, ...] | None = None
    long_inv_freq: tuple[float, ...] | None = None
    long_from: int = 0
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelArch:
    """Shapes, constants and family parts of a decoder we serve."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    hidden_act: str
    family: str = "llama"
    # Per layer: its sliding window (None: global attention) and its RoPE table (index into ropes).
    layer_windows: tuple[int | None, ...] = ()
    layer_ropes: tuple[int, ...] = ()
    ropes: tuple[RopeSpec, ...] = ()
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    qk_norm: bool = False
    gemma_norms: bool = False  # (1 + w) RMSNorms, also after attention and after the MLP
    embed_scale: float | None = None
    activation: str = "silu"  # "silu" or "gelu_tanh"
    fused_checkpoint: bool = False
    # Dimensions of each head RoPE turns (None: all of them); fewer with ``partial_rotary_factor``
    # (Phi-4-mini), served by storing q/k rows in ``kernels.rotary_layout``'s order.
    rotary_dim: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def sliding_window(self) -> int | None:
        """The widest window of the windowed layers (None when no layer has one)."""
        windows = [w for w in self.layer_windows if w]
        return max(windows) if windows else None

    @property
    def all_layers_windowed(self) -> bool:
        """Every layer has a window: blocks before the widest window serve no layer."""
        return bool(self.layer_windows) and all(self.layer_windows)

    def window_of(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (None: it attends to the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else None

    def rope_of(self, layer: int) -> int:
        """Index into ``ropes`` of layer ``layer``'s RoPE table."""
        return self.layer_ropes[layer] if self.layer_ropes else 0

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArch:
        """Read a transformers ``PretrainedConfig`` (v4 or v5 field names)."""
        model_type = getattr(config, "model_type", "")
        if model_type not in FAMILY_OF_MODEL_TYPE:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        family_name = FAMILY_OF_MODEL_TYPE[model_type]
        family = FAMILIES[family_name]
        act_name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        act = ACTIVATIONS.get(str(act_name)) if act_name else family.default_act
        if act is None:
            raise ValueError(f"hidden_act {act_name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        num_heads = int(config.num_attention_heads)
        num_layers = int(config.num_hidden_layers)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
        layer_types = _layer_types(config, family.window_layers, num_layers)
        sliding = getattr(config, "sliding_window", None)
        windows = tuple(int(sliding) if sliding and t == "sliding_attention" else None for t in layer_types)
        ropes, layer_ropes, rotary_dim = _ropes(config, layer_types, head_dim)
        attn_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=ropes[0].theta,
            rope_scaling=ropes[0].scaling,
            # The window no longer caps the context: windowed layers attend to their window
            # at any length (the kernels take it per layer).
            max_position_embeddings=int(config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=attn_bias or family.qkv_bias,
            o_bias=attn_bias and not family.qkv_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            hidden_act=str(act_name or act),
            family=family_name,
            layer_windows=windows,
            layer_ropes=layer_ropes,
            ropes=ropes,
            attn_scale=(
                float(config.query_pre_attn_scalar) ** -0.5
                if family.query_pre_attn_scalar and getattr(config, "query_pre_attn_scalar", None)
                else None
            ),
            attn_logit_softcap=_positive(getattr(config, "attn_logit_softcapping", None)),
            final_logit_softcap=_positive(getattr(config, "final_logit_softcapping", None)),
            qk_norm=family.qk_norm,
            gemma_norms=family.gemma_norms,
            embed_scale=float(config.hidden_size) ** 0.5 if family.embed_scale else None,
            activation=act,
            fused_checkpoint=family.fused_checkpoint,
            rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        )


def _positive(value: Any) -> float | None:
    return float(value) if value else None


def _layer_types(config: Any, rule: str, num_layers: int) -> list[str]:
    """Each layer's "sliding_attention" or "full_attention", from the config's ``layer_types``
    (transformers v5) or the family's rule (v4 configs)."""
    types = getattr(config, "layer_types", None)
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(
                f"layer types {sorted(unknown)} are not supported (sliding_attention, full_attention)"
            )
        return list(types)
    if not getattr(config, "sliding_window", None):
        return ["full_attention"] * num_layers
    if rule == "from_max_window_layers":
        if not getattr(config, "use_sliding_window", False):
            return ["full_attention"] * num_layers
        first = int(getattr(config, "max_window_layers", 0))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if rule == "layer_types":  # Gemma 2 v4 configs: even layers local
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    return ["sliding_attention"] * num_layers


def _rope_params(config: Any, layer_type: str) -> tuple[dict[str, Any], str | None]:
    """The RoPE parameters of ``layer_type`` (per-type dicts: Gemma 3) and the key they sit under."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type in params and isinstance(params[layer_type], dict):
        return dict(params[layer_type]), layer_type
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return params, None


def _ropes(
    config: Any, layer_types: list[str], head_dim: int
) -> tuple[tuple[RopeSpec, ...], tuple[int, ...], int]:
    """One ``RopeSpec`` per distinct layer type's parameters, each layer's index, and the
    dimensions of a head that RoPE turns (``head_dim`` unless ``partial_rotary_factor`` < 1)."""
    specs: list[RopeSpec] = []
    by_type: dict[str, int] = {}
    rotary_dims = set()
    for layer_type in dict.fromkeys(layer_types):
        params, key = _rope_params(config, layer_type)
        rotary_dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
        rotary_head_order(head_dim, rotary_dim)  # raises for a split the kernels cannot serve
        rotary_dims.add(rotary_dim)
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = float(params["rope_theta"])
        scaling = {**params, "rope_type": rope_type} if rope_type in ("linear", "llama3") else None
        if rope_type in ("default", "linear", "llama3"):
            # With a partial rotary, the frequencies span rotary_dim (as HF computes them).
            partial = rotary_dim < head_dim
            inv_freq = tuple(_inv_freq(rotary_dim, theta, scaling).tolist()) if partial else None
            spec = RopeSpec(theta, scaling, inv_freq=inv_freq)
        elif rope_type in ("yarn", "longrope", "su"):
            spec = _hf_rope(config, key, "longrope" if rope_type == "su" else rope_type, theta, params)
        else:
            raise ValueError(
                f"rope type {rope_type!r} is not supported; supported: default, linear, llama3, yarn, "
                "longrope"
            )
        if spec not in specs:
            specs.append(spec)
        by_type[layer_type] = specs.index(spec)
    if len(rotary_dims) > 1:
        raise ValueError(
            f"layer types with different partial rotary factors are not supported: {rotary_dims}"
        )
    return tuple(specs), tuple(by_type[t] for t in layer_types), rotary_dims.pop()


def _hf_rope(config: Any, key: str | None, rope_type: str, theta: float, params: dict[str, Any]) -> RopeSpec:
    """Frequencies of the scalings transformers defines (YaRN, LongRoPE), computed by transformers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fn = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, factor = fn(config, None, layer_type=key) if key else fn(config, None)
    long_freq: tuple[float, ...] | None = None
    long_from = 0
    if rope_type == "longrope":
        original = int(
            params.get("original_max_position_embeddings") or config.original_max_position_embeddings
        )
        long = (
            fn(config, None, seq_len=original + 1, layer_type=key) if key else fn(config, None, original + 1)
        )
        long_freq, long_from = tuple(float(x) for x in long[0].tolist()), original
    return RopeSpec(
        theta,
        {**params, "rope_type": rope_type},
        inv_freq=tuple(float(x) for x in inv_freq.tolist()),
        long_inv_freq=long_freq,
        long_from=long_from,
        attention_factor=float(factor),
    )


def rope_tables(spec: RopeSpec, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of ``[max_positions, head_dim]`` float32 for one RoPE table."""
    positions = torch.arange(max_positions, dtype=torch.float32)[:, None]
    if spec.inv_freq is not None:
        inv_freq = torch.tensor(spec.inv_freq, dtype=torch.float32)
    else:
        inv_freq = _inv_freq(head_dim, spec.theta, spec.scaling)
    freqs = positions * inv_freq[None, :]
    if spec.long_inv_freq is not None and max_positions > spec.long_from:
        long = torch.tensor(spec.long_inv_freq, dtype=torch.float32)
        freqs[spec.long_from :] = positions[spec.long_from :] * long[None, :]
    cos, sin = freqs.cos() * spec.attention_factor, freqs.sin() * spec.attention_factor
    rest = head_dim // 2 - freqs.shape[1]
    if rest:  # a partial rotary: the pass-through dimensions turn by nothing (kernels.rotary_layout)
        cos = torch.cat((cos, torch.ones(max_positions, rest)), dim=-1)
        sin = torch.cat((sin, torch.zeros(max_positions, rest)), dim=-1)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """Inverse RoPE frequencies ``[head_dim // 2]`` (float32) of the first RoPE table, with
    linear/Llama-3 scaling."""
    return _inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)


def _inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # Llama 3: keep high frequencies, divide low ones by factor, blend in between.
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
