"""Write a tiny HF model of any served family as a GGUF file, the way llama.cpp's converter does.

Tensor names come from the ``gguf`` package's own name map per architecture; llama's q/k
rows are interleaved for its rotary (llama.cpp's ``permute``), Gemma's norms are stored as
``1 + w`` (both undone by transformers' GGUF reader), Phi-3 keeps its fused ``qkv_proj`` /
``gate_up_proj``. Projection weights are stored Q8_0 (the engine keeps the blocks), the rest
F32. The tokenizer and chat template are copied from the bundled SmolLM2 GGUF (the tiny
models use its vocabulary), so a served file carries them as a real one does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

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
}


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


def write_family_gguf(hf_dir: Path, out: Path, family: str, tokenizer_gguf: Path) -> Path:
    """Save the model in ``hf_dir`` (safetensors, float32) as ``out`` (a GGUF of ``family``)."""
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
    writer.add_rope_freq_base(float((cfg.rope_parameters or {}).get("rope_theta", 10000.0)))
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(int(cfg.sliding_window))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
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
        elif data.ndim == 2:
            q8 = gguf.quants.quantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
