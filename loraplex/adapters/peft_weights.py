"""``adapter_model.safetensors``: check every tensor against the base model, fold scaling.

PEFT saves one pair per adapted linear layer (the adapter name is stripped)::

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in_features]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out_features, r]

The result keeps ``lora_b`` pre-multiplied by the module's own scaling, so the serving
kernels compute ``y += (x @ A^T) @ B_scaled^T`` with a slot scale of 1.0, which is
PEFT's ``lora_B(lora_A(x)) * scaling`` for every module, patterns included.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from loraplex.adapters.errors import AdapterValidationError, ValidationReason
from loraplex.adapters.peft_config import LoraSettings
from loraplex.adapters.spec import (
    FUSED_MODULES,
    FUSED_PARENT,
    MODULE_NAMES,
    MODULE_PARENT,
    BaseModelSpec,
    ModuleName,
)

_LORA_KEY = re.compile(
    r"^base_model\.model\.(?P<module_key>model\.layers\.(?P<layer>0|[1-9][0-9]*)\."
    r"(?P<parent>[A-Za-z_][A-Za-z0-9_]*)\.(?P<module>[A-Za-z_][A-Za-z0-9_]*))\.(?P<kind>lora_A|lora_B)\.weight$",
    re.ASCII,
)
"""The one name PEFT saves and loads a LoRA weight under (``get_peft_model_state_dict``): its
``base_model.model.`` prefix, the base model's module path, ASCII layer numbers without leading
zeros. PEFT's loader ignores any other spelling, so serving one would run weights PEFT never
applies; and two spellings of one module would make which one wins an accident of order."""
_ALIAS_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<module>\w+)"
    r"\.(?P<kind>lora_A|lora_B)(?:\.[^.]+)?\.weight$"
)
"""Names a lenient loader would have taken for a LoRA weight: refused with the reason why."""

ModuleKey = tuple[int, ModuleName]  # (layer_idx, module name)


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One adapted projection: ``delta(x) = (x @ lora_a^T) @ lora_b^T``."""

    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank], PEFT scaling already folded in
    scaling: float  # the factor folded into lora_b (for reporting only)

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclass(frozen=True)
class AdapterWeights:
    """All validated LoRA weights of one adapter, on the host, in the serving dtype."""

    modules: Mapping[ModuleKey, LoRAModuleWeights]

    @property
    def max_rank(self) -> int:
        return max(w.rank for w in self.modules.values())

    @property
    def target_modules(self) -> tuple[ModuleName, ...]:
        present = {module for _, module in self.modules}
        return tuple(m for m in MODULE_NAMES if m in present)

    @property
    def nbytes(self) -> int:
        return sum(
            w.lora_a.numel() * w.lora_a.element_size() + w.lora_b.numel() * w.lora_b.element_size()
            for w in self.modules.values()
        )

    def pin_memory(self) -> AdapterWeights:
        """A copy in page-locked memory, for asynchronous host-to-device copies (CUDA only)."""
        return AdapterWeights(
            {
                key: LoRAModuleWeights(w.lora_a.pin_memory(), w.lora_b.pin_memory(), w.scaling)
                for key, w in self.modules.items()
            }
        )


def activation_gain(
    lora_a: torch.Tensor,  # [rank, in_features] float32
    lora_b: torch.Tensor,  # [out_features, rank] float32, scaling folded in
) -> float:
    """How much the delta ``B @ A`` can scale an activation whose elements are about 1.

    For an input x, ``|delta_j| = |B[j] . (A x)| <= ||B[j]||_2 * ||A x||_2``, and for x in
    general position with unit-RMS elements ``||A x||_2`` is about ``||A||_F``. So the gain is
    ``||A||_F * max_j ||B[j]||_2``: O(parameters), never forming the [out, in] product.
    Computed in float64, where float32 weights cannot overflow the sums of squares.
    """
    norm_a = torch.linalg.vector_norm(lora_a.double())
    return float(norm_a) * float(torch.linalg.vector_norm(lora_b.double(), dim=1).max())


def max_activation_gain(dtype: torch.dtype) -> float:
    """The largest ``activation_gain`` an adapter may have when served in ``dtype``.

    The inputs of every adapted projection have elements around 1 (RMSNorm outputs, attention
    outputs, SwiGLU products of them). The projections' outputs are multiplied with each other
    one step later (q . k scores, silu(gate) * up, the next RMSNorm's mean of squares in float32),
    so an output above sqrt(max) of its dtype overflows there even when it is representable
    itself: sqrt(65504) = 256 in float16, about 1.8e19 in float32 and bfloat16. A trained
    adapter's delta is a small correction to base weights of magnitude < 1; even the random
    test adapters (every weight N(0, 0.5^2), scaling up to 5.7) measure 11 to 210. So the bound
    refuses only broken or mis-scaled adapters (weights of 1e30, or 1e3 in float16). It is the
    point where typical inputs overflow, not a guarantee for every input (Gaussian tails reach
    a few times the gain): an adapter just under it that still overflows is caught by the
    engine's non-finite-logits guard, which fails only the requests that use it.
    """
    return math.sqrt(torch.finfo(dtype).max)


def _fail(reason: ValidationReason, source: str, message: str) -> AdapterValidationError:
    return AdapterValidationError(reason, f"{source}: {message}")


def _classify_unknown(name: str, source: str) -> AdapterValidationError:
    """The most specific error for a tensor name that is not a LoRA weight of a known layer."""
    if "lora_magnitude_vector" in name:
        return _fail("dora", source, f"tensor {name!r} is a DoRA magnitude vector; DoRA is not supported")
    if name.endswith(".bias"):
        return _fail("bias", source, f"tensor {name!r} is a bias; only bias='none' is supported")
    if "modules_to_save" in name:
        return _fail("modules_to_save", source, f"tensor {name!r} belongs to modules_to_save")
    if "lora_embedding" in name or "embed_tokens" in name or "lm_head" in name:
        return _fail(
            "unsupported_target",
            source,
            f"tensor {name!r} adapts a module outside {list(MODULE_NAMES)}",
        )
    match = _LORA_KEY.match(name)
    if match is not None:
        return _fail(
            "unsupported_target",
            source,
            f"tensor {name!r} adapts {match['parent']}.{match['module']}; "
            f"supported modules are {[f'{MODULE_PARENT[m]}.{m}' for m in MODULE_NAMES]}",
        )
    alias = _ALIAS_KEY.match(name)
    if alias is not None:
        return _fail(
            "unexpected_tensor",
            source,
            f"tensor {name!r} is not spelled as PEFT saves it (base_model.model.model.layers.<n>.<module>"
            ".lora_A.weight, <n> in ASCII digits without leading zeros); PEFT would not load it",
        )
    return _fail("unexpected_tensor", source, f"tensor {name!r} is not a LoRA weight of a decoder layer")


def _parent(module: str) -> str | None:
    if module in MODULE_PARENT:
        return MODULE_PARENT[module]
    return FUSED_PARENT.get(module)


def _parse_names(
    tensors: Mapping[str, torch.Tensor], spec: BaseModelSpec, source: str
) -> dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]]:
    """Group tensors by (layer, module); reject names the engine cannot place, and modules the
    served family does not have (Phi-3's fused ``qkv_proj`` on a Llama, ``q_proj`` on a Phi-3)."""
    found: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    allowed = spec.adaptable_modules()
    for name in sorted(tensors):
        match = _LORA_KEY.match(name)
        module = match["module"] if match else ""
        if match is None or _parent(module) is None or _parent(module) != match["parent"]:
            raise _classify_unknown(name, source)
        if module not in allowed:
            raise _fail(
                "unsupported_target",
                source,
                f"tensor {name!r} adapts {module}, which the served model does not have; "
                f"its LoRA-able modules are {list(allowed)}",
            )
        layer = int(match["layer"])
        if layer >= spec.num_layers:
            raise _fail(
                "layer_out_of_range",
                source,
                f"tensor {name!r} is for layer {layer}, but the base model has {spec.num_layers} layers",
            )
        key = (layer, module)
        pair = found.setdefault(key, {})
        if match["kind"] in pair:  # unreachable with one spelling per module; kept as the rule
            raise _fail(
                "unexpected_tensor",
                source,
                f"tensor {name!r} is a second {match['kind']} for layer {layer} {module}",
            )
        pair[match["kind"]] = (match["module_key"], tensors[name])
    return found


def parse_weights(
    tensors: Mapping[str, torch.Tensor],
    settings: LoraSettings,
    spec: BaseModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    source: str,
    check_values: bool = True,
) -> AdapterWeights:
    """Validate ``tensors`` (a PEFT state dict) and return them scaled, in ``dtype``, on the CPU.

    ``check_values=False`` skips the value checks (finite, magnitude), which cost most of a
    parse: only for bytes whose content hash matches a version these checks passed before
    (a store re-read); names, shapes and ranks are still checked, they build the modules."""
    if not tensors:
        raise _fail("missing_tensor", source, "the safetensors file holds no tensors")
    modules: dict[ModuleKey, LoRAModuleWeights] = {}
    for (layer, module), pair in _parse_names(tensors, spec, source).items():
        where = f"layer {layer} {module}"
        for kind in ("lora_A", "lora_B"):
            if kind not in pair:
                raise _fail("missing_tensor", source, f"{where} has no {kind} weight")
        module_key, a = pair["lora_A"]
        _, b = pair["lora_B"]
        for kind, t in (("lora_A", a), ("lora_B", b)):
            if not t.is_floating_point():
                raise _fail("bad_dtype", source, f"{where} {kind} has dtype {t.dtype}; expected a float type")
        if module in FUSED_MODULES:
            in_features, out_features = spec.fused_features(module)
        else:
            in_features, out_features = spec.features(cast(ModuleName, module))
        rank = int(a.shape[0]) if a.dim() == 2 else -1
        if a.dim() != 2 or a.shape[1] != in_features or b.dim() != 2 or b.shape[0] != out_features:
            raise _fail(
                "shape_mismatch",
                source,
                f"{where}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the base model's "
                f"[{out_features}, {in_features}] layer "
                f"(expected [r, {in_features}] and [{out_features}, r])",
            )
        if b.shape[1] != rank:
            raise _fail(
                "rank_mismatch", source, f"{where}: lora_A has rank {rank} but lora_B has {b.shape[1]}"
            )
        config_rank, scaling = settings.rank_and_scaling(module_key)
        if rank != config_rank:
            raise _fail(
                "rank_mismatch",
                source,
                f"{where}: tensors have rank {rank} but the config (r / rank_pattern) says {config_rank}",
            )
        if rank > max_rank:
            raise _fail(
                "rank_too_large",
                source,
                f"{where} has rank {rank} > max_lora_rank {max_rank}; retrain with r <= {max_rank} "
                "or raise max_lora_rank",
            )
        a32, b32 = a.to(torch.float32), b.to(torch.float32)
        if not check_values:
            lora_b = (b32 * scaling).to(dtype).contiguous()
            _store(modules, layer, module, spec, a32.to(dtype).contiguous(), lora_b, scaling)
            continue
        for kind, t in (("lora_A", a32), ("lora_B", b32)):
            if not bool(torch.isfinite(t).all()):
                raise _fail("non_finite", source, f"{where} {kind} contains NaN or Inf")
        b32_scaled = b32 * scaling
        lora_a = a32.to(dtype).contiguous()
        lora_b = b32_scaled.to(dtype).contiguous()
        for kind, t in (("lora_A", lora_a), ("lora_B (scaled)", lora_b)):
            if not bool(torch.isfinite(t).all()):
                raise _fail("non_finite", source, f"{where} {kind} overflows {dtype} (values too large)")
        gain = activation_gain(a32, b32_scaled)
        limit = max_activation_gain(dtype)
        if not gain <= limit:
            raise _fail(
                "weight_magnitude",
                source,
                f"{where}: the scaled weights amplify a unit activation up to {gain:.3g} "
                f"(||A||_F * max row ||B * scaling||), over the {limit:.3g} that {dtype} activations "
                "can take without overflowing; the adapter is broken or mis-scaled",
            )
        _store(modules, layer, module, spec, lora_a, lora_b, scaling)
    return AdapterWeights(modules)


def _store(
    modules: dict[ModuleKey, LoRAModuleWeights],
    layer: int,
    module: str,
    spec: BaseModelSpec,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> None:
    """Keep one module's weights; a fused one (``qkv_proj``) as its slices, which share A and
    take their rows of B: ``B[rows] @ A x`` is the slice's part of ``B @ A x``, exactly."""
    parts = FUSED_MODULES.get(module)
    if parts is None:
        modules[(layer, cast(ModuleName, module))] = LoRAModuleWeights(
            lora_a, _in_row_order(spec, cast(ModuleName, module), lora_b), scaling
        )
        return
    start = 0
    for part in parts:
        rows = spec.features(part)[1]
        b = _in_row_order(spec, part, lora_b[start : start + rows])
        modules[(layer, part)] = LoRAModuleWeights(lora_a, b.contiguous(), scaling)
        start += rows


def _in_row_order(spec: BaseModelSpec, module: ModuleName, lora_b: torch.Tensor) -> torch.Tensor:
    """``lora_b``'s rows in the order the served base keeps ``module``'s (a partial rotary)."""
    order = spec.row_order(module)
    return lora_b if order is None else lora_b[order].contiguous()


def load_weights(
    data: bytes,
    settings: LoraSettings,
    spec: BaseModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    source: str,
    check_values: bool = True,
) -> AdapterWeights:
    """Parse safetensors ``data`` (no pickle anywhere) and validate it with ``parse_weights``."""
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise _fail("bad_weights", source, f"not a valid safetensors file ({exc})") from exc
    return parse_weights(tensors, settings, spec, max_rank, dtype, source, check_values)
