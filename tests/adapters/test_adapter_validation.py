"""Each rejection names its problem, takes no slot and leaves no files behind."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.adapters import (
    CONFIG,
    WEIGHTS,
    edit_config,
    edit_tensors,
    files_under,
    key,
    make_adapter,
    tiny_config,
)

from loraplex.adapters import AdapterManager, AdapterValidationError, LoRARequest
from loraplex.adapters.peft_weights import activation_gain, max_activation_gain


class _Evil:
    """Unpickling this would create the marker file: proves pickles are never loaded."""

    marker = ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def _pickle_only(path: Path, suffix: str) -> Path:
    make_adapter(path)
    (path / WEIGHTS).unlink()
    evil = _Evil()
    _Evil.marker = str(path.parent / "PWNED")
    (path / f"adapter_model{suffix}").write_bytes(pickle.dumps(evil))
    return path


def _set(tensor_key: str, value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[tensor_key][0, 0] = value

    return edit


def _with_config(**updates: Any) -> Callable[[Path], Path]:
    def build(path: Path) -> Path:
        make_adapter(path)
        edit_config(path, **updates)
        return path

    return build


def _with_tensors(edit: Callable[[dict[str, torch.Tensor]], None], **lora: Any) -> Callable[[Path], Path]:
    def build(path: Path) -> Path:
        make_adapter(path, **lora)
        edit_tensors(path, edit)
        return path

    return build


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[name]

    return edit


def _add(name: str, tensor: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda tensors: tensors.__setitem__(name, tensor)


# name -> (builder, reason, words the message must contain)
REJECTIONS: dict[str, tuple[Callable[[Path], Path], str, tuple[str, ...]]] = {
    "embed_tokens_target": (
        lambda p: make_adapter(p, target_modules=["q_proj", "embed_tokens"]),
        "unsupported_target",
        ("embed_tokens",),
    ),
    "lm_head_target": (
        lambda p: make_adapter(p, target_modules=["v_proj", "lm_head"]),
        "unsupported_target",
        ("lm_head",),
    ),
    "lm_head_tensor_via_regex": (
        lambda p: make_adapter(p, target_modules=r".*(q_proj|lm_head)"),
        "unsupported_target",
        ("lm_head",),
    ),
    "rank_too_large": (lambda p: make_adapter(p, r=16, lora_alpha=16), "rank_too_large", ("16", "8")),
    "rank_pattern_too_large": (
        lambda p: make_adapter(p, r=4, rank_pattern={"down_proj": 12}),
        "rank_too_large",
        ("down_proj", "12"),
    ),
    "shape_mismatch": (
        lambda p: make_adapter(p, config=tiny_config(hidden_size=96)),
        "shape_mismatch",
        ("layer 0 down_proj", "lora_B [96, 4]", "[64, 128] layer"),
    ),
    "too_many_layers": (
        lambda p: make_adapter(p, config=tiny_config(num_hidden_layers=3)),
        "layer_out_of_range",
        ("layer 2", "2 layers"),
    ),
    "nan": (_with_tensors(_set(key(1, "up_proj", "B"), float("nan"))), "non_finite", ("up_proj", "NaN")),
    "inf": (_with_tensors(_set(key(0, "q_proj", "A"), float("inf"))), "non_finite", ("q_proj", "Inf")),
    "huge_finite_a": (
        _with_tensors(_set(key(0, "k_proj", "A"), 1e30)),
        "weight_magnitude",
        ("layer 0 k_proj", "overflowing"),
    ),
    "huge_finite_b": (
        _with_tensors(_set(key(1, "down_proj", "B"), 1e30)),
        "weight_magnitude",
        ("layer 1 down_proj", "overflowing"),
    ),
    "bias_all": (_with_config(bias="all"), "bias", ("bias='all'",)),
    "lora_bias": (_with_config(lora_bias=True), "bias", ("lora_bias",)),
    "bias_tensor": (
        _with_tensors(_add("base_model.model.model.layers.0.self_attn.q_proj.bias", torch.zeros(64))),
        "bias",
        ("q_proj.bias",),
    ),
    "modules_to_save": (
        lambda p: make_adapter(p, modules_to_save=["lm_head"]),
        "modules_to_save",
        ("modules_to_save", "lm_head"),
    ),
    "dora": (lambda p: make_adapter(p, use_dora=True), "dora", ("DoRA",)),
    "dora_tensor_only": (
        _with_tensors(
            _add(key(0, "q_proj").replace("lora_A.weight", "lora_magnitude_vector"), torch.ones(64))
        ),
        "dora",
        ("lora_magnitude_vector",),
    ),
    "pickle_bin": (lambda p: _pickle_only(p, ".bin"), "pickle_format", ("adapter_model.bin", "pickle")),
    "pickle_pt": (lambda p: _pickle_only(p, ".pt"), "pickle_format", ("adapter_model.pt",)),
    "missing_config": (
        lambda p: (make_adapter(p), (p / CONFIG).unlink(), p)[-1],
        "missing_config",
        ("adapter_config.json",),
    ),
    "bad_json": (
        lambda p: (make_adapter(p), (p / CONFIG).write_text("{not json"), p)[-1],
        "bad_config",
        ("JSON",),
    ),
    "peft_type_ia3": (_with_config(peft_type="IA3"), "unsupported_peft_type", ("IA3",)),
    "pissa_unconverted": (_with_config(init_lora_weights="pissa"), "unsupported_feature", ("pissa",)),
    "fan_in_fan_out": (_with_config(fan_in_fan_out=True), "unsupported_feature", ("fan_in_fan_out",)),
    "rank_config_mismatch": (_with_config(r=3), "rank_mismatch", ("rank 4", "3")),
    "missing_lora_b": (
        _with_tensors(_drop(key(1, "o_proj", "B"))),
        "missing_tensor",
        ("layer 1 o_proj", "lora_B"),
    ),
    "unexpected_tensor": (
        _with_tensors(_add("base_model.model.model.norm.weight", torch.ones(64))),
        "unexpected_tensor",
        ("model.norm.weight",),
    ),
    "int_dtype": (
        _with_tensors(_add(key(0, "q_proj"), torch.ones(4, 64, dtype=torch.int32))),
        "bad_dtype",
        ("int32",),
    ),
    "garbage_safetensors": (
        lambda p: (make_adapter(p), (p / WEIGHTS).write_bytes(b"\x00" * 64), p)[-1],
        "bad_weights",
        ("safetensors",),
    ),
    "empty_safetensors": (_with_tensors(lambda t: t.clear()), "missing_tensor", ("no tensors",)),
}


def _assert_nothing_left(manager: AdapterManager, store_dir: Path) -> None:
    assert manager.list_adapters() == []
    assert manager.num_free_slots == manager.config.max_loras
    assert all(s == 0.0 for s in manager.get_buffers(0, "qkv").scales.tolist())
    assert files_under(store_dir) == [], f"left behind: {files_under(store_dir)}"
    manager.check_integrity()


@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_rejection_names_the_problem_and_leaves_nothing(
    case: str, tmp_path: Path, store_dir: Path, make_manager: Any
) -> None:
    build, reason, words = REJECTIONS[case]
    path = build(tmp_path / "upload" / case)
    manager = make_manager(max_lora_rank=8)
    with pytest.raises(AdapterValidationError) as info:
        manager.add_lora(LoRARequest(case, 1, str(path)))
    assert info.value.reason == reason, str(info.value)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"
    assert isinstance(info.value, ValueError)
    _assert_nothing_left(manager, store_dir)
    assert not (path.parent / "PWNED").exists(), "a pickle was unpickled"


def test_rejected_adapter_does_not_disturb_a_served_one(
    tmp_path: Path, store_dir: Path, make_manager: Any
) -> None:
    manager = make_manager()
    good = make_adapter(tmp_path / "good")
    manager.add_lora(LoRARequest("good", 1, str(good)))
    slot_idx = manager.acquire(1, "req")
    before = manager.get_buffers(0, "qkv").lora_a.clone()
    bad = _with_tensors(_set(key(0, "q_proj", "A"), float("nan")))(tmp_path / "bad")
    with pytest.raises(AdapterValidationError):
        manager.add_lora(LoRARequest("bad", 2, str(bad)))
    assert [a.adapter_id for a in manager.list_adapters()] == [1]
    assert manager.slot_of(1) == slot_idx
    assert torch.equal(manager.get_buffers(0, "qkv").lora_a, before)
    assert [p.name for p in store_dir.iterdir()] == [manager.get_adapter(1).version]
    manager.check_integrity()


def test_fp16_overflow_after_scaling_is_rejected(tmp_path: Path, make_manager: Any) -> None:
    path = make_adapter(tmp_path / "a", r=4, lora_alpha=8)
    edit_tensors(path, _set(key(0, "q_proj", "B"), 60000.0))  # * scaling 2 > 65504
    manager = make_manager(dtype=torch.float16)
    with pytest.raises(AdapterValidationError, match="overflows") as info:
        manager.add_lora(LoRARequest("a", 1, str(path)))
    assert info.value.reason == "non_finite"


def test_magnitude_bound_depends_on_the_serving_dtype(tmp_path: Path, make_manager: Any) -> None:
    """A weight of 300 is representable in float16, but its delta times an O(1) activation is
    squared one step later (q . k, silu(gate) * up) and overflows; float32 has room."""
    path = make_adapter(tmp_path / "a", r=4, lora_alpha=8)
    edit_tensors(path, _set(key(1, "up_proj", "A"), 300.0))
    with pytest.raises(AdapterValidationError, match="layer 1 up_proj") as info:
        make_manager(dtype=torch.float16).add_lora(LoRARequest("a", 1, str(path)))
    assert info.value.reason == "weight_magnitude"
    assert "256" in str(info.value)  # sqrt(65504), the bound the message names
    make_manager(dtype=torch.float32, store_dir=tmp_path / "store32").add_lora(LoRARequest("a", 1, str(path)))


@pytest.mark.parametrize(
    "lora",
    [dict(r=4, lora_alpha=8), dict(r=8, lora_alpha=16, use_rslora=True), dict(r=2, lora_alpha=2)],
    ids=["plain", "rslora_scaled", "small"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_normal_adapters_pass_the_magnitude_bound(
    lora: dict[str, Any], dtype: torch.dtype, tmp_path: Path, make_manager: Any
) -> None:
    path = make_adapter(tmp_path / "a", **lora)
    manager = make_manager(dtype=dtype)
    manager.add_lora(LoRARequest("a", 1, str(path)))
    manager.check_integrity()


def test_activation_gain_is_the_scale_deltas_reach(tmp_path: Path) -> None:
    """The gain the bound is applied to is the scale of the deltas of unit-RMS inputs (x ~ N(0, 1)):
    the largest of 256 inputs' deltas lands within a Gaussian tail (a few times) of it."""
    gen = torch.Generator().manual_seed(0)
    for rank, in_features, out_features, scale in [(4, 64, 128, 0.5), (16, 512, 256, 0.02), (1, 32, 32, 3.0)]:
        a = torch.randn(rank, in_features, generator=gen) * scale
        b = torch.randn(out_features, rank, generator=gen) * scale
        gain = activation_gain(a, b)
        x = torch.randn(256, in_features, generator=gen)
        largest = float(((x @ a.T) @ b.T).abs().max())
        assert gain / 10 < largest < 5 * gain, (rank, gain, largest)
    assert max_activation_gain(torch.float16) == pytest.approx(255.94, abs=0.01)
    assert max_activation_gain(torch.float32) == pytest.approx(1.845e19, rel=1e-3)


def test_missing_path_and_plain_file(tmp_path: Path, make_manager: Any) -> None:
    manager = make_manager()
    with pytest.raises(AdapterValidationError) as info:
        manager.add_lora(LoRARequest("x", 1, str(tmp_path / "nope")))
    assert info.value.reason == "not_found"
    (tmp_path / "weights.pt").write_bytes(b"x")
    with pytest.raises(AdapterValidationError) as info:
        manager.add_lora(LoRARequest("x", 1, str(tmp_path / "weights.pt")))
    assert info.value.reason == "pickle_format"


def test_safetensors_beside_pickles_is_used_and_pickles_ignored(
    tmp_path: Path, store_dir: Path, make_manager: Any
) -> None:
    path = make_adapter(tmp_path / "a")
    _Evil.marker = str(tmp_path / "PWNED")
    (path / "adapter_model.bin").write_bytes(pickle.dumps(_Evil()))
    manager = make_manager()
    info = manager.add_lora(LoRARequest("a", 1, str(path)))
    assert not (tmp_path / "PWNED").exists()
    assert sorted(p.name for p in (store_dir / info.version).iterdir()) == [CONFIG, WEIGHTS]


def test_oversized_weights_file_is_refused_before_reading(tmp_path: Path, make_manager: Any) -> None:
    path = make_adapter(tmp_path / "a")
    manager = make_manager(max_lora_rank=1)
    limit = manager.spec.max_adapter_bytes(1)
    with (path / WEIGHTS).open("ab") as fh:
        fh.truncate(limit + 1)
    with pytest.raises(AdapterValidationError) as info:
        manager.add_lora(LoRARequest("a", 1, str(path)))
    assert info.value.reason == "too_large"
    assert json.loads((path / CONFIG).read_text())["r"] == 4  # untouched source
