"""Models for the tests: tiny random HF models (and their GGUF files), the bundled SmolLM2.

Fixtures (a pytest plugin, listed in ``pytest_plugins`` of tests/conftest.py):

    smollm2_dir   session: the bundled SmolLM2 as an HF directory (its tokenizer serves the tiny models)
    tiny_dirs     session: tiny random models covering MHA, GQA, tied embeddings and q/k/v bias, by name
                  (``gqa_tied`` is the one most tests serve)

make_tiny_model_dir / make_tiny_family_dir   save a tiny random model of a family
write_family_gguf                            save one as a GGUF file, as llama.cpp's converter does
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
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
    _widen(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = tokenizer_dir / name
        if src.exists():
            shutil.copy(src, out_dir / name)
    return out_dir


FAMILY_WINDOW = 32  # the tiny family models' sliding window: prompts go past it


def family_config(
    family: str,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 0,
    **overrides: Any,
) -> Any:
    """A tiny HF config of ``family`` (SmolLM2's vocabulary) with every part of the family on:
    a 32-token window where the family has one, soft-capping, two RoPE bases, LongRoPE.
    ``overrides`` are config attributes set on it afterwards (``query_pre_attn_scalar=16``)."""
    cfg = _family_config(family, hidden, layers, heads, kv_heads, head_dim)
    for key, value in overrides.items():
        if not hasattr(cfg, key):
            raise AttributeError(f"{type(cfg).__name__} has no {key}")
        setattr(cfg, key, value)
    return cfg


def _family_config(family: str, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> Any:
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
    if family in ("phi3", "phi4_mini"):
        # Phi-4-mini is a Phi-3 whose RoPE turns 3/4 of each head (partial_rotary_factor).
        partial = 0.75 if family == "phi4_mini" else 1.0
        half = int(head_dim * partial) // 2
        return Phi3Config(
            **{**common, "max_position_embeddings": 1024},
            original_max_position_embeddings=256,
            sliding_window=48,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": partial,
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


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from loraplex.platform.model.source import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> dict[str, Path]:
    """Tiny random models covering MHA, GQA, tied embeddings and q/k/v bias."""
    root = tmp_path_factory.mktemp("tiny")
    specs = {
        "mha_untied": dict(heads=4, kv_heads=4, tie=False),
        "gqa_tied": dict(heads=4, kv_heads=2, tie=True, seed=1),
        "gqa3_bias": dict(heads=6, kv_heads=2, hidden=96, bias=True, seed=2),
        "qwen2": dict(model_type="qwen2", heads=4, kv_heads=2, seed=3),
        "llama3_rope": dict(
            heads=4,
            kv_heads=1,
            seed=4,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    }
    return {name: make_tiny_model_dir(root / name, smollm2_dir, **kw) for name, kw in specs.items()}  # type: ignore[arg-type]


# Write a tiny HF model of any served family as a GGUF file, the way llama.cpp's converter does.
#
# Tensor names come from the ``gguf`` package's own name map per architecture; llama's q/k
# rows are interleaved for its rotary (llama.cpp's ``permute``), Gemma's norms are stored as
# ``1 + w`` (both undone by transformers' GGUF reader), Phi-3 keeps its fused ``qkv_proj`` /
# ``gate_up_proj``. Projection weights are stored Q8_0 (the engine keeps the blocks), the rest
# F32 (or everything F32). Metadata as llama.cpp writes it: heads, window, soft-capping, RoPE.
# The tokenizer and chat template are copied from the bundled SmolLM2 GGUF (the tiny models use
# its vocabulary), so a served file carries them as a real one does.

GGUF_ARCH = {
    "llama": "llama",
    # llama.cpp writes Mistral as "llama" (and transformers cannot read a "mistral" file with
    # this gguf-py: its tables have no such arch), so a Mistral GGUF is served as Llama.
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "phi4_mini": "phi3",
}


def _llama3_rope_divisors(rope: dict[str, Any], dim: int) -> np.ndarray:
    """What llama.cpp stores as ``rope_freqs`` for Llama 3 scaling: each frequency's divisor."""
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    theta = float(rope.get("rope_theta", 10000.0))
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rows from rotate-half to interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _copy_tokenizer(writer: Any, source: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)


def write_family_gguf(
    hf_dir: Path, out: Path, family: str, tokenizer_gguf: Path, *, quantize: bool = True
) -> Path:
    """Save the model in ``hf_dir`` (safetensors, float32) as ``out`` (a GGUF of ``family``):
    projections Q8_0, or (``quantize=False``) every tensor F32, which transformers' reader gives
    back bit for bit, so the converted model can be compared with ``hf_dir``'s exactly."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_dir)
    arch_name = GGUF_ARCH[family]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer = gguf.GGUFWriter(str(out), arch_name)
    writer.add_name(f"tiny-{family}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters or {}
    scaled = rope.get("full_attention", rope)  # Gemma 3: the global layers' RoPE is the scaled one
    writer.add_rope_freq_base(float(scaled.get("rope_theta", 10000.0)))
    writer.add_vocab_size(cfg.vocab_size)
    # The dimensions RoPE turns (llama.cpp writes head_dim x partial_rotary_factor).
    partial = float((cfg.rope_parameters or {}).get("partial_rotary_factor") or 1.0)
    writer.add_rope_dimension_count(int(head_dim * partial))
    if scaled.get("rope_type") == "linear":  # as llama.cpp writes it
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaled["factor"]))
    if rope.get("rope_type") == "llama3":  # as llama.cpp's Llama converter: each frequency's divisor
        writer.add_tensor("rope_freqs.weight", _llama3_rope_divisors(rope, int(head_dim * partial)))
    if rope.get("rope_type") == "longrope":  # as llama.cpp's Phi-3 converter: the factors as tensors
        original = int(cfg.original_max_position_embeddings)
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(int(cfg.sliding_window))
    # Soft-capping as llama.cpp's converters write it: Gemma 2 both values always, Gemma 3 only
    # a final one (its attention has none).
    if family == "gemma2":
        writer.add_attn_logit_softcapping(float(cfg.attn_logit_softcapping))
        writer.add_final_logit_softcapping(float(cfg.final_logit_softcapping))
    if family == "gemma3" and cfg.final_logit_softcapping:
        writer.add_final_logit_softcapping(float(cfg.final_logit_softcapping))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantize else gguf.LlamaFileType.ALL_F32)
    _copy_tokenizer(writer, tokenizer_gguf)

    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    state = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(path)))
    for hf_name, tensor in state.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KeyError(f"no GGUF name for {hf_name} in {arch_name}")
        data = tensor.to(torch.float32).numpy()
        if family.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1.0
        if arch_name == "llama" and hf_name.endswith("q_proj.weight"):
            data = _permute(data, heads)
        if arch_name == "llama" and hf_name.endswith("k_proj.weight"):
            data = _permute(data, kv_heads)
        if data.ndim == 2 and ".blk." not in f".{name}" and name != "token_embd.weight":
            writer.add_tensor(name, np.ascontiguousarray(data))
        elif data.ndim == 2 and quantize:
            q8 = gguf.quants.quantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
