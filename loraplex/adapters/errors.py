"""Errors raised by the adapter subsystem.

Everything that guards user input (an uploaded adapter, an adapter id in a request)
raises one of these explicitly; none of them is an ``assert``. Each validation error
carries a stable ``reason`` code, so the gateway can map it to an API error and tests
can check *which* rule fired, plus a message that names the file, tensor or number.
"""

from __future__ import annotations

from typing import Literal

ValidationReason = Literal[
    "not_found",  # the path does not exist
    "missing_config",  # no adapter_config.json
    "bad_config",  # adapter_config.json is not valid JSON / has wrong field types
    "missing_weights",  # no adapter_model.safetensors
    "pickle_format",  # only .bin/.pt/.pth/.pkl/.ckpt weights: refused, never unpickled
    "bad_weights",  # the safetensors file cannot be parsed
    "unsupported_peft_type",  # peft_type is not LORA
    "unsupported_target",  # a module outside q/k/v/o/gate/up/down (embed_tokens, lm_head, ...)
    "unsupported_feature",  # a LoRA variant the kernels cannot serve (fan_in_fan_out, aLoRA, ...)
    "modules_to_save",  # fully fine-tuned extra modules
    "dora",  # use_dora / lora_magnitude_vector
    "bias",  # bias != "none", lora_bias, or bias tensors
    "rank_too_large",  # r > max_lora_rank
    "rank_mismatch",  # tensor rank differs from r / rank_pattern
    "shape_mismatch",  # tensor shape differs from the base model's layer
    "layer_out_of_range",  # layer index >= the base model's num_layers
    "missing_tensor",  # lora_A without lora_B (or the reverse), or no tensors at all
    "unexpected_tensor",  # a tensor name that is not a LoRA weight of a known layer
    "bad_dtype",  # a non floating point tensor
    "non_finite",  # NaN or Inf (also after conversion to the serving dtype)
    "weight_magnitude",  # finite, but large enough to overflow the activations (see max_activation_gain)
    "too_large",  # file bigger than any valid adapter for this base model could be
    "unsafe_archive",  # path traversal, absolute path, link, device, encrypted member
    "archive_too_large",  # member or total size, or member count, over the limit
    "bad_archive",  # unreadable or unsupported archive, or ambiguous layout
    "changed_on_disk",  # stored files no longer match the version hash
    "exceeds_lora_memory",  # its pages alone are more than the adapter page budget (lora_memory)
]


class AdapterError(Exception):
    """Base class of every adapter error."""


class AdapterValidationError(AdapterError, ValueError):
    """An adapter was rejected; ``reason`` says which rule, the message says where."""

    def __init__(self, reason: ValidationReason, message: str) -> None:
        super().__init__(f"[{reason}] {message}")
        self.reason: ValidationReason = reason
        self.detail = message


class AdapterNotFoundError(AdapterError, KeyError):
    """No adapter is registered under this id or name, or none the caller may use: the one
    "adapter not found" of every layer (the engine, the gateway's database, the routes; over HTTP
    a 404 ``model_not_found``). ``name``: the model name a client asked for (``for_model``);
    None for an engine-internal id, which a client is never shown."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name

    @classmethod
    def for_model(cls, name: str) -> AdapterNotFoundError:
        """A client's ``model`` that names no adapter it may use (or no model at all)."""
        return cls(f"The model '{name}' does not exist.", name)

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "adapter not found"


class AdapterRemovedError(AdapterNotFoundError):
    """The adapter was removed; requests already running finish, new ones are refused."""


class AdapterExistsError(AdapterError, ValueError):
    """An adapter id or (owner, name) is already registered with different content."""


class NoFreeSlotError(AdapterError, RuntimeError):
    """Every adapter slot is pinned by a running request; the caller must wait."""
