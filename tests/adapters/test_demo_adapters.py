"""scripts/make_demo_adapters.py: a short run yields an adapter that validates and changes greedy output."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.adapters import AdapterWeights, BaseModelSpec, read_adapter

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_demo_adapters.py"
PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location("make_demo_adapters", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _hook_deltas(model: Any, weights: AdapterWeights) -> list[Any]:
    """Add our parsed (pre-scaled) LoRA deltas to the HF model's projections with forward hooks."""
    handles = []
    for (layer, module), w in weights.modules.items():
        parent = getattr(model.model.layers[layer], PARENTS.get(module, "mlp"))
        a, b = w.lora_a, w.lora_b

        def hook(_mod: Any, inputs: tuple[Any, ...], output: Any, a: Any = a, b: Any = b) -> Any:
            return output + (inputs[0] @ a.T) @ b.T

        handles.append(getattr(parent, module).register_forward_hook(hook))
    return handles


@pytest.mark.slow
def test_short_demo_run_validates_and_changes_greedy_output(
    tmp_path: Path, smollm2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    script = _load_script()
    out = tmp_path / "demo"
    argv = ["--adapters", "json", "--steps", "8", "--out", str(out), "--max-new-tokens", "12"]
    assert script.main([*argv, "--model-dir", str(smollm2_dir)]) == 0
    printed = capsys.readouterr().out
    assert "== json" in printed and "before:" in printed and "after:" in printed

    spec = BaseModelSpec.from_hf_config(AutoConfig.from_pretrained(smollm2_dir))
    parsed = read_adapter(out / "json", spec, max_rank=16, dtype=torch.float32)
    assert parsed.weights.target_modules == ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    prompt = script.EVAL_PROMPTS[0]
    base = script.greedy_answers(model, tokenizer, [prompt], 12)[0]
    handles = _hook_deltas(model, parsed.weights)
    ours = script.greedy_answers(model, tokenizer, [prompt], 12)[0]
    for handle in handles:
        handle.remove()
    peft = script.greedy_answers(PeftModel.from_pretrained(model, out / "json"), tokenizer, [prompt], 12)[0]
    assert ours != base, f"adapter did not change greedy output: {base!r}"
    assert ours == peft, f"our parsed weights give {ours!r}, PEFT gives {peft!r}"
