"""The base model's LoRA-able layers, and how the engine stacks them.

The engine's Llama-family model fuses projections, so adapter slots are stacked per
*group*, one slice per PEFT module, in this fixed order:

=========  ==============================  ===================================
group      slices (PEFT module names)      fused layer it feeds
=========  ==============================  ===================================
qkv        q_proj, k_proj, v_proj          ``self_attn.qkv_proj`` output
o          o_proj                          ``self_attn.o_proj``
gate_up    gate_proj, up_proj              ``mlp.gate_up_proj`` output
down       down_proj                       ``mlp.down_proj``
=========  ==============================  ===================================

Families whose checkpoints store the fused projections (Phi-3: ``self_attn.qkv_proj``,
``mlp.gate_up_proj``) are adapted on those: a PEFT LoRA of ``qkv_proj`` has one A and a B
whose rows are q | k | v, so it becomes the three slices ``q_proj``, ``k_proj``, ``v_proj``
sharing that A, each with its rows of B (``FUSED_MODULES``): the same delta, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

from loraplex.kernels.rotary_layout import rotary_row_order

ModuleName = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GroupName = Literal["qkv", "o", "gate_up", "down"]

MODULE_NAMES: tuple[ModuleName, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
GROUPS: dict[GroupName, tuple[ModuleName, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# PEFT module names of fused checkpoints (Phi-3) -> the slices they are split into, in row order.
FUSED_MODULES: dict[str, tuple[ModuleName, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
FUSED_PARENT = {"qkv_proj": "self_attn", "gate_up_proj": "mlp"}
# Model types whose checkpoints (and so their adapters) have the fused modules instead.
FUSED_MODEL_TYPES = ("phi3",)
# Submodule that holds each projection in HF Llama/Mistral/Qwen2/Qwen3/Gemma models.
MODULE_PARENT: dict[ModuleName, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


@dataclass(frozen=True)
class BaseModelSpec:
    """Shapes of the base model's LoRA-able linear layers (identical in every layer).

    Each ``*_features`` pair is ``(in_features, out_features)`` of that projection,
    i.e. its weight has shape ``[out_features, in_features]``.
    """

    num_layers: int
    q_proj: tuple[int, int]
    k_proj: tuple[int, int]
    v_proj: tuple[int, int]
    o_proj: tuple[int, int]
    gate_proj: tuple[int, int]
    up_proj: tuple[int, int]
    down_proj: tuple[int, int]
    # The served family's checkpoint fuses q|k|v and gate|up (Phi-3): adapters target
    # ``qkv_proj`` / ``gate_up_proj`` and not the separate modules (and the other way round).
    fused_projections: bool = False
    # A partial rotary (``partial_rotary_factor`` < 1, Phi-4-mini): the base keeps each q / k
    # head's rows in ``kernels.rotary_layout``'s order, so an adapter's rows of B are kept so too.
    head_dim: int = 0
    rotary_dim: int | None = None

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        for module in MODULE_NAMES:
            dims = getattr(self, module)
            if len(dims) != 2 or min(dims) < 1:
                raise ValueError(f"{module} must be (in_features, out_features) >= 1, got {dims}")
        for group, modules in GROUPS.items():
            ins = {self.features(m)[0] for m in modules}
            if len(ins) != 1:
                raise ValueError(f"group {group!r} stacks {modules} whose in_features differ: {sorted(ins)}")

    @classmethod
    def from_hf_config(cls, config: Any) -> BaseModelSpec:
        """Build from a transformers Llama/Mistral/Qwen2 config (or any object with its fields)."""
        hidden = int(config.hidden_size)
        intermediate = int(config.intermediate_size)
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        head_dim = getattr(config, "head_dim", None) or hidden // num_heads
        q_out, kv_out = num_heads * int(head_dim), num_kv_heads * int(head_dim)
        return cls(
            num_layers=int(config.num_hidden_layers),
            q_proj=(hidden, q_out),
            k_proj=(hidden, kv_out),
            v_proj=(hidden, kv_out),
            o_proj=(q_out, hidden),
            gate_proj=(hidden, intermediate),
            up_proj=(hidden, intermediate),
            down_proj=(intermediate, hidden),
            fused_projections=getattr(config, "model_type", "") in FUSED_MODEL_TYPES,
            head_dim=int(head_dim),
            rotary_dim=_partial_rotary_dim(config, int(head_dim)),
        )

    def row_order(self, module: ModuleName) -> list[int] | None:
        """The order the served base keeps ``module``'s output rows in (None: the checkpoint's)."""
        if self.rotary_dim is None or module not in ("q_proj", "k_proj"):
            return None
        heads = self.features(module)[1] // self.head_dim
        return rotary_row_order(heads, self.head_dim, self.rotary_dim)

    def adaptable_modules(self) -> tuple[str, ...]:
        """The PEFT module names an adapter of the served family may target."""
        if self.fused_projections:
            return ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        return MODULE_NAMES

    def fused_features(self, fused: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of a fused module (``qkv_proj``, ``gate_up_proj``)."""
        parts = FUSED_MODULES[fused]
        return self.features(parts[0])[0], sum(self.features(m)[1] for m in parts)

    def features(self, module: ModuleName) -> tuple[int, int]:
        """``(in_features, out_features)`` of ``module``."""
        dims: tuple[int, int] = getattr(self, module)
        return dims

    def group_in_features(self, group: GroupName) -> int:
        """The input width shared by every slice of ``group``."""
        return self.features(GROUPS[group][0])[0]

    def slice_sizes(self, group: GroupName) -> tuple[int, ...]:
        """Output width of each slice of ``group``, in stacking order."""
        return tuple(self.features(m)[1] for m in GROUPS[group])

    @cached_property
    def max_adapter_numel(self) -> int:
        """Elements of A and B over all layers and modules, per unit of rank."""
        return self.num_layers * sum(sum(self.features(m)) for m in MODULE_NAMES)

    def max_adapter_bytes(self, max_rank: int) -> int:
        """Upper bound on a valid adapter's safetensors size (float64 weights, plus header slack)."""
        return self.max_adapter_numel * max_rank * 8 + (1 << 20)


def _partial_rotary_dim(config: Any, head_dim: int) -> int | None:
    """The rotary part of a head when the config turns only part of it (None: all of it)."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    factor = float(factor or getattr(config, "partial_rotary_factor", None) or 1.0)
    rotary_dim = int(head_dim * factor)
    return rotary_dim if rotary_dim < head_dim else None
