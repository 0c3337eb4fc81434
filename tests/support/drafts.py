"""Draft models for speculative decoding: a model's first layers as a model of their own."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def make_layer_draft(model_dir: Path, out_dir: Path, num_layers: int) -> Path:
    """Save ``model_dir``'s first ``num_layers`` decoder layers, with its embeddings, final norm
    and LM head, as a Hugging Face model in ``out_dir`` (tokenizer files copied): a draft that
    agrees with its model often, but not always (LayerSkip's early exit as a separate model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    for name in ("layer_types", "max_window_layers"):  # per-layer lists cut to the layers kept
        value = getattr(model.config, name, None)
        if isinstance(value, list):
            setattr(model.config, name, value[:num_layers])
    model.save_pretrained(out_dir, safe_serialization=True)
    for src in model_dir.iterdir():
        if src.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(src, out_dir / src.name)
    return out_dir
