"""Adapter files that PEFT would read differently are refused, with the reason (hostile clients, 5).

PEFT loads a LoRA weight under exactly one name (``base_model.model.model.layers.<n>.<parent>.
<module>.lora_A.weight``) and ignores every other spelling. A lenient parser that also took the
bare ``model.layers...`` form, ``layers.03`` or non-ASCII digits would serve weights PEFT never
applies, and with two spellings of one module, whichever sorts last. A config that PEFT itself
refuses (``peft_type: "lora"``) or that breaks a naive parser (deep nesting, a 5,000-digit number)
is a validation error, never a crash.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.adapters import CONFIG, edit_config, edit_tensors, key, make_adapter

from loraplex.adapters import AdapterManager, AdapterValidationError, LoRARequest

Q_A = key(0, "q_proj")
"""The canonical name of one weight the test adapter has."""


def _alias(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    """Add a second spelling of layer 0 q_proj's lora_A, with different values."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[Q_A] * 3

    return edit


def _rename(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    """Spell layer 0 q_proj's lora_A only as ``name``."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors.pop(Q_A)

    return edit


ALIASES = {
    "no_peft_prefix": "model.layers.0.self_attn.q_proj.lora_A.weight",
    "no_model_prefix": "base_model.model.layers.0.self_attn.q_proj.lora_A.weight",
    "bare_layers": "layers.0.self_attn.q_proj.lora_A.weight",
    "leading_zero": "base_model.model.model.layers.00.self_attn.q_proj.lora_A.weight",
    "arabic_indic_digit": "base_model.model.model.layers.\u0660.self_attn.q_proj.lora_A.weight",
    "fullwidth_digit": "base_model.model.model.layers.\uff10.self_attn.q_proj.lora_A.weight",
    "adapter_name_kept": "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
}


def _refused(manager: AdapterManager, path: Path) -> AdapterValidationError:
    with pytest.raises(AdapterValidationError) as info:
        manager.add_lora(LoRARequest(path.name, 1, str(path)))
    assert manager.list_adapters() == []
    return info.value


@pytest.mark.parametrize("form", sorted(ALIASES))
@pytest.mark.parametrize("edit", [_alias, _rename], ids=["beside_the_canonical_name", "instead_of_it"])
def test_each_alias_form_is_refused_with_a_reason(
    form: str,
    edit: Callable[[str], Callable[[dict[str, torch.Tensor]], None]],
    tmp_path: Path,
    make_manager: Any,
) -> None:
    path = make_adapter(tmp_path / form)
    edit_tensors(path, edit(ALIASES[form]))
    error = _refused(make_manager(max_lora_rank=8), path)
    assert error.reason == "unexpected_tensor", str(error)
    assert ALIASES[form] in str(error) and "PEFT" in str(error), str(error)


@pytest.mark.parametrize("peft_type", ["lora", "Lora", " LORA", "LORA\u0000"])
def test_peft_type_must_be_spelled_as_peft_spells_it(
    peft_type: str, tmp_path: Path, make_manager: Any
) -> None:
    path = make_adapter(tmp_path / "a")
    edit_config(path, peft_type=peft_type)
    error = _refused(make_manager(max_lora_rank=8), path)
    assert error.reason == "unsupported_peft_type" and "'LORA'" in str(error), str(error)


@pytest.mark.parametrize(
    "config,words",
    [
        ('{"peft_type": "LORA", "r": 4, "x": ' + "[" * 100_000 + "]" * 100_000 + "}", ("nested",)),
        ('{"peft_type": "LORA", "r": ' + "9" * 5000 + "}", ("too many digits",)),
        ('{"peft_type": "LORA", "r": 4, "lora_alpha": NaN}', ("NaN",)),
    ],
    ids=["nested_100000_deep", "5000_digit_integer", "nan"],
)
def test_hostile_configs_are_a_validation_error(
    config: str, words: tuple[str, ...], tmp_path: Path, make_manager: Any
) -> None:
    path = make_adapter(tmp_path / "a")
    (path / CONFIG).write_text(config)
    error = _refused(make_manager(max_lora_rank=8), path)
    assert error.reason == "bad_config", str(error)
    for word in words:
        assert word in str(error), str(error)


def test_the_canonical_names_still_load(tmp_path: Path, make_manager: Any) -> None:
    manager = make_manager(max_lora_rank=8)
    manager.add_lora(LoRARequest("good", 1, str(make_adapter(tmp_path / "good"))))
    assert [a.adapter_id for a in manager.list_adapters()] == [1]
