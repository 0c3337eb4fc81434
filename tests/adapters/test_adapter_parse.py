"""The parser and slot buffers reproduce PEFT's per-module LoRA delta exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.adapters import ALL_MODULES, make_adapter, make_peft_model, peft_deltas, random_inputs

from loraplex.adapters import GROUPS, AdapterManager, BaseModelSpec, LoRARequest, read_adapter
from loraplex.adapters.peft_config import pattern_key

CASES: dict[str, dict[str, Any]] = {
    "plain": dict(r=4, lora_alpha=8),
    "rslora": dict(r=4, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "patterns": dict(
        r=4,
        lora_alpha=8,
        rank_pattern={"layers.1.self_attn.q_proj": 2, "down_proj": 8},
        alpha_pattern={"v_proj": 3, "model.layers.0.mlp.up_proj": 5, "^model.layers.1.mlp.gate_proj": 11},
    ),
    "rslora_patterns": dict(
        r=6, lora_alpha=4, use_rslora=True, rank_pattern={"k_proj": 3}, alpha_pattern={"o_proj": 9}
    ),
    "all_linear": dict(r=3, lora_alpha=5, target_modules="all-linear"),
    "one_layer": dict(r=4, lora_alpha=8, layers_to_transform=[1], target_modules=["q_proj", "up_proj"]),
    "regex_targets": dict(r=2, lora_alpha=2, target_modules=r".*layers\.0\.self_attn\.(k|v)_proj"),
}


def _slot_delta(
    manager: AdapterManager, adapter_id: int, layer: int, module: str, x: torch.Tensor
) -> torch.Tensor:
    """``scale * (x @ A^T) @ B^T`` for one module, summed over the adapter's pages in the pool."""
    tables = manager.pages_of(adapter_id)
    assert tables is not None, "adapter not resident"
    for group, modules in GROUPS.items():
        if module in modules:
            i = modules.index(module)  # type: ignore[arg-type]
            delta = torch.zeros(x.shape[0], manager.spec.features(module)[1], device=x.device)  # type: ignore[arg-type]
            for page in tables.get(group, []):
                buf = manager.get_buffers(layer, group)
                out = buf.slice_sizes[i]
                a = buf.lora_a[i, page].float()
                b = buf.lora_b[i, page, :out].float()
                delta += (x @ a.T) @ b.T * buf.scales[page]
            return delta
    raise AssertionError(module)


@pytest.mark.parametrize("case", sorted(CASES))
def test_slot_buffers_match_peft_per_module(
    case: str, tmp_path: Path, spec: BaseModelSpec, make_manager: Any
) -> None:
    kwargs = dict(CASES[case])
    peft_model = make_peft_model(seed=3, **kwargs)
    peft_model.save_pretrained(tmp_path / case)
    manager = make_manager(max_loras=2, max_lora_rank=8)
    manager.add_lora(LoRARequest(case, 1, str(tmp_path / case)))
    manager.acquire(1, "req")

    xs = random_inputs(spec)
    expected = peft_deltas(peft_model, xs)
    assert expected, "PEFT adapted no module"
    for layer in range(spec.num_layers):
        for module in ALL_MODULES:
            x = xs[spec.features(module)[0]]  # type: ignore[arg-type]
            got = _slot_delta(manager, 1, layer, module, x)
            want = expected.get((layer, module))  # type: ignore[arg-type]
            if want is None:
                assert torch.count_nonzero(got) == 0, f"{module} layer {layer} is not adapted but has a delta"
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{case} {module} L{layer}")
    manager.release("req")
    manager.check_integrity()


def test_parsed_ranks_and_scalings_follow_patterns(tmp_path: Path, spec: BaseModelSpec) -> None:
    path = make_adapter(tmp_path / "a", **CASES["patterns"])
    parsed = read_adapter(path, spec, max_rank=8, dtype=torch.float32)
    mods = parsed.weights.modules
    assert mods[(1, "q_proj")].rank == 2 and mods[(0, "q_proj")].rank == 4
    assert mods[(0, "down_proj")].rank == 8
    assert mods[(0, "v_proj")].scaling == pytest.approx(3 / 4)
    assert mods[(0, "up_proj")].scaling == pytest.approx(5 / 4)
    assert mods[(1, "up_proj")].scaling == pytest.approx(8 / 4)
    assert mods[(1, "gate_proj")].scaling == pytest.approx(11 / 4)
    assert mods[(0, "down_proj")].scaling == pytest.approx(8 / 8)
    assert parsed.weights.max_rank == 8
    assert parsed.weights.target_modules == tuple(ALL_MODULES)


def test_rslora_scaling_is_alpha_over_sqrt_r(tmp_path: Path, spec: BaseModelSpec) -> None:
    path = make_adapter(tmp_path / "a", **CASES["rslora_patterns"])
    mods = read_adapter(path, spec, max_rank=8, dtype=torch.float32).weights.modules
    assert mods[(0, "k_proj")].scaling == pytest.approx(4 / 3**0.5)
    assert mods[(0, "o_proj")].scaling == pytest.approx(9 / 6**0.5)
    assert mods[(0, "q_proj")].scaling == pytest.approx(4 / 6**0.5)


def test_pattern_key_matches_peft() -> None:
    from peft.utils.other import get_pattern_key

    patterns = ["layers.1.self_attn.q_proj", "q_proj", "^model.layers.0.mlp.up_proj", "mlp\\..*_proj"]
    names = [
        "model.layers.1.self_attn.q_proj",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.1.mlp.up_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.11.self_attn.q_proj",
    ]
    for name in names:
        peft_key = get_pattern_key(patterns, name)
        ours = pattern_key(patterns, name)
        assert (ours if ours is not None else name) == peft_key, name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weights_are_converted_to_the_serving_dtype(
    dtype: torch.dtype, tmp_path: Path, spec: BaseModelSpec, make_manager: Any
) -> None:
    peft_model = make_peft_model(seed=5, r=4, lora_alpha=8)
    peft_model.save_pretrained(tmp_path / "a")
    manager = make_manager(dtype=dtype)
    manager.add_lora(LoRARequest("a", 1, str(tmp_path / "a")))
    manager.acquire(1, "req")
    assert manager.get_buffers(0, "qkv").lora_a.dtype == dtype
    xs = random_inputs(spec)
    want = peft_deltas(peft_model, xs)[(1, "down_proj")]
    got = _slot_delta(manager, 1, 1, "down_proj", xs[spec.down_proj[0]])
    torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-2)


def test_fused_groups_apply_with_the_torch_backend(
    tmp_path: Path, spec: BaseModelSpec, make_manager: Any
) -> None:
    """Two adapters of ranks 4 and 8 in pages of 4 rows (one and two pages), one flat batch,
    one ``apply_paged`` call: the backend reproduces PEFT per token."""
    lora_mod = pytest.importorskip("loraplex.kernels.portable.lora")
    from loraplex.kernels.metadata import LoRAMetadata

    backend = lora_mod.PortableLoRABackend()
    models = {1: make_peft_model(seed=11, r=4, lora_alpha=8), 2: make_peft_model(seed=12, r=8, lora_alpha=4)}
    manager = make_manager(max_loras=3, max_lora_rank=8, lora_page_rank=4)
    pages: dict[int, list[int]] = {}
    for adapter_id, model in models.items():
        model.save_pretrained(tmp_path / str(adapter_id))
        manager.add_lora(LoRARequest(f"a{adapter_id}", adapter_id, str(tmp_path / str(adapter_id))))
        manager.acquire(adapter_id, f"r{adapter_id}")
        table = manager.pages_of(adapter_id)
        assert table is not None
        pages[adapter_id] = table["qkv"]
    assert [len(pages[1]), len(pages[2])] == [1, 2]

    token_adapters = [1, 1, 0, 2, 2, 2, 0]
    passes = tuple(
        LoRAMetadata.from_token_slots(
            [pages[a][i] if a and len(pages[a]) > i else -1 for a in token_adapters], torch.device("cpu")
        )
        for i in range(2)
    )
    x = torch.randn(len(token_adapters), spec.q_proj[0], generator=torch.Generator().manual_seed(0))
    buf = manager.get_buffers(1, "qkv")
    y = torch.zeros(len(token_adapters), sum(buf.slice_sizes))
    backend.apply_paged(y, x, buf.lora_a, buf.lora_b, buf.scales, buf.slice_sizes, passes)

    for t, adapter_id in enumerate(token_adapters):
        if adapter_id == 0:
            assert torch.count_nonzero(y[t]) == 0
            continue
        deltas = peft_deltas(models[adapter_id], {spec.q_proj[0]: x[t : t + 1]})
        want = torch.cat([deltas[(1, m)] for m in ("q_proj", "k_proj", "v_proj")], dim=-1)[0]
        torch.testing.assert_close(y[t], want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_slots_on_cuda_match_peft(tmp_path: Path, spec: BaseModelSpec, make_manager: Any) -> None:
    """Pinned host memory and non-blocking copies land the same weights in device slots."""
    peft_model = make_peft_model(seed=21, **CASES["patterns"])
    peft_model.save_pretrained(tmp_path / "a")
    manager = make_manager(max_loras=2, max_lora_rank=8)
    cuda_manager = AdapterManager(spec, manager.config, device="cuda", dtype=torch.float16)
    try:
        cuda_manager.add_lora(LoRARequest("a", 1, str(tmp_path / "a")))
        assert cuda_manager.acquire(1, "r") == 0
        xs = random_inputs(spec)
        expected = peft_deltas(peft_model, xs)
        for (layer, module), want in expected.items():
            x = xs[spec.features(module)[0]].cuda()
            got = _slot_delta(cuda_manager, 1, layer, module, x).cpu()
            torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-2)
        cuda_manager.release("r")
        cuda_manager.check_integrity()
    finally:
        cuda_manager.close()
