"""``adapter_config.json``: parse, reject what the engine cannot serve, resolve scaling.

Scaling follows PEFT exactly (``peft/tuners/lora/model.py::_create_and_replace`` and
``layer.py::update_layer``): for a module whose full name in the base model is
``key`` (e.g. ``model.layers.3.self_attn.q_proj``)::

    r     = rank_pattern[first pattern p with re.match(rf"(.*\\.)?({p})$", key)]  else config r
    alpha = alpha_pattern[same rule]                                               else lora_alpha
    scaling = alpha / sqrt(r) if use_rslora else alpha / r

The patterns come from tenants: they are matched by ``patterns.LinearPattern`` (same syntax and
meaning, linear time, no backtracking), compiled once per key and cached process-wide with
their answers, so the engine loading an adapter the gateway validated does not match again.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loraplex import strict_json
from loraplex.adapters.errors import AdapterValidationError, ValidationReason
from loraplex.adapters.patterns import LinearPattern, UnsupportedPattern
from loraplex.adapters.spec import FUSED_MODULES, MODULE_NAMES

# init_lora_weights values whose adapters only work on a *modified* base model
# (PEFT rewrites the base weights at init). PEFT resets the field to True when it
# converts such an adapter back to a plain LoRA on save.
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")
# LoRA variants with a forward pass other than x @ A^T @ B^T * scaling.
_VARIANT_FIELDS = (
    "use_qalora",
    "use_bdlora",
    "alora_invocation_tokens",
    "velora_config",
    "kasa_config",
    "monteclora_config",
    "arrow_config",
    "layer_replication",
    "trainable_token_indices",
    "target_parameters",
)


MAX_PATTERNS = 1024
"""rank_pattern and alpha_pattern keys of one config, together."""
MAX_PATTERN_STATES = 4096
"""NFA states of the non-literal keys of one config, together: what bounds the cost of matching
every module name of the model (literal keys, the usual case, are compared as text)."""


@functools.lru_cache(maxsize=512)
def compiled_pattern(key: str) -> LinearPattern:
    """The matcher of one pattern key (``UnsupportedPattern`` if it is not one we run)."""
    return LinearPattern(key)


def pattern_key(pattern_keys: Sequence[str], module_key: str) -> str | None:
    """The first pattern that matches ``module_key`` by PEFT's rule, or None."""
    return _first_match(tuple(pattern_keys), module_key)


@functools.lru_cache(maxsize=16384)
def _first_match(pattern_keys: tuple[str, ...], module_key: str) -> str | None:
    # Cached: the engine loading an adapter the gateway has validated asks again.
    for key in pattern_keys:
        if compiled_pattern(key).matches(module_key):
            return key
    return None


@dataclass(frozen=True)
class LoraSettings:
    """The fields of a PEFT LoRA config that decide how the weights are applied."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)

    def rank_and_scaling(self, module_key: str) -> tuple[int, float]:
        """``(r, scaling)`` PEFT gives the module named ``module_key``."""
        r_key = pattern_key(tuple(self.rank_pattern), module_key)
        alpha_key = pattern_key(tuple(self.alpha_pattern), module_key)
        r = self.rank_pattern[r_key] if r_key is not None else self.r
        alpha = self.alpha_pattern[alpha_key] if alpha_key is not None else self.lora_alpha
        scaling = alpha / math.sqrt(r) if self.use_rslora else alpha / r
        return r, scaling


def _fail(reason: ValidationReason, source: str, message: str) -> AdapterValidationError:
    return AdapterValidationError(reason, f"{source}: {message}")


def _is_set(value: Any) -> bool:
    return value not in (None, False, [], {}, "")


def _positive_int(value: Any, what: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail("bad_config", source, f"{what} must be a positive integer, got {value!r}")
    return value


def _number(value: Any, what: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail("bad_config", source, f"{what} must be a finite number, got {value!r}")
    return float(value)


def _check_targets(raw: Any, source: str) -> tuple[str, ...] | str:
    if raw is None or isinstance(raw, str):
        # "all-linear", a regex, or unset: the tensor names are checked one by one later.
        return raw or ""
    if not isinstance(raw, list) or not raw or not all(isinstance(t, str) for t in raw):
        raise _fail("bad_config", source, f"target_modules must be a non-empty list or a string, got {raw!r}")
    # Phi-3's fused qkv_proj / gate_up_proj too; the tensors are checked against the served
    # family's own module names later (BaseModelSpec.adaptable_modules).
    known = (*MODULE_NAMES, *FUSED_MODULES)
    bad = sorted(t for t in raw if t.rsplit(".", 1)[-1] not in known)
    if bad:
        raise _fail(
            "unsupported_target",
            source,
            f"target_modules {bad} are not supported; LoRA may target only {list(known)}",
        )
    return tuple(raw)


def parse_lora_config(raw: bytes, source: str) -> LoraSettings:
    """Parse ``adapter_config.json`` bytes; raise ``AdapterValidationError`` on anything unservable."""
    try:
        # The request bodies' parser: bounded depth and integer digits, so a config nested 100,000
        # deep or holding a 5,000-digit number is a 400 with a reason, not a crash.
        config = strict_json.loads(raw)
    except strict_json.JSONLimitError as exc:
        raise _fail("bad_config", source, f"not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise _fail("bad_config", source, f"must hold a JSON object, got {type(config).__name__}")

    # PEFT's own values only: its PeftType enum is upper case, and PEFT refuses "lora".
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _fail(
            "unsupported_peft_type",
            source,
            f"peft_type is {peft_type!r}; only 'LORA' (PEFT's spelling) is supported",
        )
    if _is_set(config.get("use_dora")):
        raise _fail("dora", source, "use_dora=true: DoRA adapters are not supported; train without use_dora")
    bias = config.get("bias", "none")
    if bias != "none":
        raise _fail("bias", source, f"bias={bias!r}: only bias='none' is supported (no trained biases)")
    if _is_set(config.get("lora_bias")):
        raise _fail("bias", source, "lora_bias=true: LoRA B biases are not supported")
    if _is_set(config.get("modules_to_save")):
        raise _fail(
            "modules_to_save",
            source,
            f"modules_to_save={config['modules_to_save']!r}: fully trained extra modules are not supported",
        )
    if _is_set(config.get("fan_in_fan_out")):
        raise _fail("unsupported_feature", source, "fan_in_fan_out=true (Conv1D layers) is not supported")
    for name in _VARIANT_FIELDS:
        if _is_set(config.get(name)):
            raise _fail("unsupported_feature", source, f"{name}={config[name]!r} is not supported")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise _fail(
            "unsupported_feature",
            source,
            f"init_lora_weights={init!r} changes the base weights; save it converted "
            "(save_pretrained(path_initial_model_for_weight_conversion=...))",
        )

    r = _positive_int(config.get("r", 8), "r", source)
    alpha = _number(config.get("lora_alpha", 8), "lora_alpha", source)
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not isinstance(alpha_pattern, dict):
        raise _fail("bad_config", source, "rank_pattern and alpha_pattern must be JSON objects")
    ranks = {str(k): _positive_int(v, f"rank_pattern[{k!r}]", source) for k, v in rank_pattern.items()}
    alphas = {str(k): _number(v, f"alpha_pattern[{k!r}]", source) for k, v in alpha_pattern.items()}
    if len(ranks) + len(alphas) > MAX_PATTERNS:
        raise _fail("bad_config", source, f"over {MAX_PATTERNS} rank_pattern / alpha_pattern keys")
    num_states = 0
    for pattern in (*ranks, *alphas):
        shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
        try:
            num_states += compiled_pattern(pattern).num_states
        except UnsupportedPattern as exc:
            raise _fail("bad_config", source, f"pattern {shown!r} cannot be used: {exc}") from None
        if num_states > MAX_PATTERN_STATES:
            raise _fail(
                "bad_config",
                source,
                f"the rank_pattern / alpha_pattern regexes are too complex together (over "
                f"{MAX_PATTERN_STATES} states at {shown!r}); list module names instead",
            )
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _fail("bad_config", source, f"use_rslora must be true or false, got {use_rslora!r}")
    return LoraSettings(
        r=r,
        lora_alpha=alpha,
        use_rslora=use_rslora,
        target_modules=_check_targets(config.get("target_modules"), source),
        rank_pattern=ranks,
        alpha_pattern=alphas,
    )
