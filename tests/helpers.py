"""Shared test helpers: tiny random HF models and greedy references from HF transformers."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def make_tiny_model_dir(
    out_dir: Path,
    tokenizer_dir: Path,
    *,
    model_type: str = "llama",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 4,
    tie: bool = False,
    bias: bool = False,
    intermediate: int = 128,
    seed: int = 0,
    rope_scaling: dict[str, Any] | None = None,
) -> Path:
    """Save a randomly initialised HF Llama/Qwen2 (SmolLM2 tokenizer, vocab 49152) to ``out_dir``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(seed)
    common = dict(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if model_type == "qwen2":
        cfg: Any = Qwen2Config(**common)
    else:
        cfg = LlamaConfig(**common, attention_bias=bias)
        if rope_scaling is not None:
            cfg.rope_parameters = {"rope_theta": 10000.0, **rope_scaling}
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init is tiny-scale; widen it so logits are not all near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif p.dim() == 2:
                p.normal_(0.0, 0.08)
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = tokenizer_dir / name
        if src.exists():
            shutil.copy(src, out_dir / name)
    return out_dir


FAMILY_WINDOW = 32  # the tiny family models' sliding window: prompts go past it


def family_config(
    family: str, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 0
) -> Any:
    """A tiny HF config of ``family`` (SmolLM2's vocabulary) with every part of the family on:
    a 32-token window where the family has one, soft-capping, two RoPE bases, LongRoPE."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    common: dict[str, Any] = dict(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    head_dim = head_dim or hidden // heads
    w = FAMILY_WINDOW
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":  # sliding window on the layers from max_window_layers on
        return Qwen2Config(**common, use_sliding_window=True, sliding_window=w, max_window_layers=1)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=head_dim)
    if family == "mistral":
        return MistralConfig(**common, head_dim=head_dim, sliding_window=w)
    if family == "gemma2":
        return Gemma2Config(
            **common,
            head_dim=head_dim,
            query_pre_attn_scalar=24,
            sliding_window=w,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=8.0,
        )
    if family == "gemma3":
        gemma3_layers = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        return Gemma3TextConfig(
            **common,
            head_dim=head_dim,
            query_pre_attn_scalar=24,
            sliding_window=w,
            layer_types=gemma3_layers,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            },
        )
    if family == "phi3":
        half = head_dim // 2
        return Phi3Config(
            **{**common, "max_position_embeddings": 1024},
            original_max_position_embeddings=256,
            sliding_window=48,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.05 * i for i in range(half)],
                "long_factor": [1.0 + 0.5 * i for i in range(half)],
            },
        )
    raise ValueError(f"no tiny config for {family!r}")


def make_tiny_family_dir(out_dir: Path, tokenizer_dir: Path, family: str, seed: int = 0, **kw: Any) -> Path:
    """Save a randomly initialised tiny model of ``family`` (``family_config``) to ``out_dir``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **kw), dtype=torch.float32)
    _widen(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = tokenizer_dir / name
        if src.exists():
            shutil.copy(src, out_dir / name)
    return out_dir


def _widen(model: Any) -> None:
    # Random init is tiny-scale; widen it so logits are not all near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif p.dim() == 2:
                p.normal_(0.0, 0.08)
            else:
                p.normal_(0.0, 0.05)


@dataclass
class Reference:
    """Greedy tokens from HF ``generate`` plus each step's logprobs (for the near-tie rule)."""

    tokens: list[int]
    step_logprobs: list[torch.Tensor]  # one [vocab] tensor per generated token


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]) -> Reference:
    """HF transformers greedy decoding of one prompt (batch 1, no padding)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=list(eos_ids),
            pad_token_id=eos_ids[0],
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [s[0].float().log_softmax(-1) for s in out.scores]
    return Reference(tokens, logprobs)


def assert_greedy_match(ours: list[int], ref: Reference, tol: float = 1e-4, what: str = "") -> None:
    """Equal token for token, except a divergence at a near tie (top-2 logprobs within ``tol``)."""
    for i, (a, b) in enumerate(zip(ours, ref.tokens, strict=False)):
        if a != b:
            top2 = ref.step_logprobs[i].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < tol, (
                f"{what}: token {i} differs ({a} vs {b}) and the reference's top-2 gap is {gap:.3g}"
            )
            return  # after a legitimate near-tie the continuations may differ
    assert len(ours) == len(ref.tokens), (
        f"{what}: lengths differ: {len(ours)} vs {len(ref.tokens)}\n{ours}\n{ref.tokens}"
    )


BENCHMARKS_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> Any:
    """Import ``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCHMARKS_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


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
