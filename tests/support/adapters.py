"""LoRA adapters for the tests: real PEFT adapters, written by ``peft`` or by hand, and ways to corrupt them.

make_adapter / make_peft_model   a random PEFT adapter over a tiny random Llama (``tiny_spec``)
make_peft_adapter                a random PEFT adapter for a model directory (``tiny_dirs``' models)
make_small_adapter               a PEFT-format adapter written without ``peft`` (fast), for a model directory
edit_tensors / edit_config       change a saved adapter in place
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from loraplex.adapters import BaseModelSpec, ModuleName

TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def tiny_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY, **overrides})


def tiny_spec(**overrides: Any) -> BaseModelSpec:
    return BaseModelSpec.from_hf_config(tiny_config(**overrides))


def make_peft_model(seed: int = 0, config: Any = None, **lora_kwargs: Any) -> Any:
    """A PEFT model over a tiny random Llama, with every LoRA weight random and non-zero."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config if config is not None else tiny_config())
    lora_kwargs.setdefault("target_modules", ALL_MODULES)
    lora_kwargs.setdefault("r", 4)
    lora_kwargs.setdefault("lora_alpha", 8)
    peft_model = get_peft_model(model, LoraConfig(**lora_kwargs))
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name or "lora_embedding" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return peft_model.eval()


def make_adapter(path: Path, seed: int = 0, config: Any = None, **lora_kwargs: Any) -> Path:
    """Save a random PEFT adapter (``save_pretrained``) to ``path``; return ``path``."""
    safe = lora_kwargs.pop("safe_serialization", True)
    make_peft_model(seed, config, **lora_kwargs).save_pretrained(path, safe_serialization=safe)
    return path


def edit_tensors(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Load the adapter's safetensors, let ``edit`` change the dict in place, save it back."""
    tensors = load_file(folder / WEIGHTS)
    edit(tensors)
    save_file(tensors, folder / WEIGHTS)


def edit_config(folder: Path, **updates: Any) -> None:
    config = json.loads((folder / CONFIG).read_text())
    config.update(updates)
    (folder / CONFIG).write_text(json.dumps(config, indent=2))


def key(layer: int, module: str, kind: str = "A") -> str:
    """The PEFT state-dict name of one LoRA weight."""
    parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{kind}.weight"


def peft_deltas(
    peft_model: Any, x_by_in: dict[int, torch.Tensor]
) -> dict[tuple[int, ModuleName], torch.Tensor]:
    """PEFT's own ``lora_B(lora_A(x)) * scaling`` for every adapted module (x chosen by in_features)."""
    from peft.tuners.lora import Linear as LoraLinear

    deltas: dict[tuple[int, ModuleName], torch.Tensor] = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLinear) or "default" not in module.lora_A:
            continue
        if module.in_features not in x_by_in:
            continue
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1])
        x = x_by_in[module.in_features]
        with torch.no_grad():
            delta = module.lora_B["default"](module.lora_A["default"](x)) * module.scaling["default"]
        deltas[(layer, parts[-1])] = delta  # type: ignore[index]
    return deltas


def random_inputs(spec: BaseModelSpec, num_tokens: int = 5, seed: int = 7) -> dict[int, torch.Tensor]:
    """One random ``[num_tokens, in_features]`` input per distinct in_features of the model."""
    gen = torch.Generator().manual_seed(seed)
    widths = {spec.features(m)[0] for m in ALL_MODULES}  # type: ignore[arg-type]
    return {w: torch.randn(num_tokens, w, generator=gen) for w in sorted(widths)}


def files_under(folder: Path) -> list[Path]:
    """Every file and folder under ``folder`` (empty list when it does not exist)."""
    return sorted(folder.rglob("*")) if folder.exists() else []


def make_peft_adapter(base_dir: Path, out: Path, seed: int, spec: dict[str, Any]) -> Any:
    """Save a PEFT LoRA with random (non-zero) A and B for the HF model in ``base_dir``; return it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(**spec))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    peft_model.save_pretrained(out)
    return peft_model.eval()


def make_small_adapter(base_dir: Path, out: Path, rank: int = 4, seed: int = 0) -> Path:
    """A PEFT LoRA (q_proj and v_proj of every layer) with small random weights."""
    cfg = json.loads((base_dir / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    outs = {"q_proj": cfg["num_attention_heads"] * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for module, out_features in outs.items():
            key = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(outs),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": str(base_dir),
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out
