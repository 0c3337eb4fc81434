"""GGUF files of every family: a tiny model written with the ``gguf`` package (``support.models``,
Q8_0 projections, the tokenizer and chat template of the bundled SmolLM2 file) is served as a
file, its blocks kept packed (``quantization="auto"``), and gives HF transformers' greedy tokens
on the same weights (the directory transformers' GGUF reader de-quantised them into). The chat
template served is the file's, unchanged. And that directory is the model the file was written
from: what the reader drops of the attention (head size, soft-capping, windows, Gemma's scale)
is put back from the file, so an F32 file gives the logits of the folder it came from.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from support.fidelity import assert_greedy_match, hf_greedy
from support.models import make_tiny_family_dir, write_family_gguf

from loraplex import LLM, SamplingParams
from loraplex.kernels.contracts import PackedWeight
from loraplex.platform.model.arch import ModelArch
from loraplex.platform.model.loader import load_hf_config
from loraplex.platform.model.source import (
    _restore_attention,
    _restore_head_dim,
    default_gguf_path,
    resolve_model_dir,
)

FAST = ["phi3", "phi4_mini"]  # fused projections, LongRoPE factors as tensors, a partial rotary
SLOW = ["gemma2", "qwen2", "qwen3", "mistral", "gemma3"]  # run in CI (-m slow), ~15-20 s each


def _check_family(family: str, root: Path, smollm2_dir: Path) -> None:
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # Heads neither hidden_size / heads wide nor Qwen3Config's default 128: the file's key_length.
    extra = {"head_dim": 24} if family == "qwen3" else {}
    hf_dir = make_tiny_family_dir(root / "hf", smollm2_dir, family, seed=21, **extra)
    path = write_family_gguf(hf_dir, root / f"tiny-{family}.gguf", family, default_gguf_path())
    converted = resolve_model_dir(str(path))
    # transformers' reader drops Phi-3's RoPE (LongRoPE factors, the rotary part): put back.
    want, got = AutoConfig.from_pretrained(hf_dir), AutoConfig.from_pretrained(converted)
    assert got.rope_parameters.keys() == want.rope_parameters.keys(), f"{family}: the file's RoPE"
    for key, value in want.rope_parameters.items():  # the factors went through float32
        assert got.rope_parameters[key] == (pytest.approx(value) if not isinstance(value, str) else value), (
            key
        )
    if want.rope_parameters.get("rope_type") == "longrope":
        assert got.original_max_position_embeddings == want.original_max_position_embeddings
    hf = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (3, 31, 33, 70)]
    refs = [hf_greedy(hf, p, 8, (2,)) for p in prompts]

    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=128)
    layer = llm.llm_engine.model.layers[0]
    assert isinstance(layer.qkv_weight, PackedWeight), "the file's Q8_0 blocks are kept packed"
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_greedy_match(out.outputs[0].token_ids, ref, what=f"{family} gguf prompt {i}")

    # The chat template is the file's own, as the server's chat endpoint applies it.
    reader = gguf.GGUFReader(str(path))
    template = reader.fields["tokenizer.chat_template"].contents()
    assert AutoTokenizer.from_pretrained(converted).chat_template == template


@pytest.mark.slow
@pytest.mark.parametrize("family", FAST)
def test_family_gguf_matches_hf(family: str, tmp_path: Path, smollm2_dir: Path) -> None:
    _check_family(family, tmp_path, smollm2_dir)


@pytest.mark.slow
@pytest.mark.parametrize("family", SLOW)
def test_family_gguf_matches_hf_slow(family: str, tmp_path: Path, smollm2_dir: Path) -> None:
    _check_family(family, tmp_path, smollm2_dir)


@pytest.mark.slow
def test_llama3_rope_scaling_survives_the_conversion(
    tmp_path: Path, tiny_dirs: dict[str, Path], smollm2_dir: Path
) -> None:
    """llama.cpp stores Llama 3's RoPE scaling as a divisor per frequency (``rope_freqs``), which
    transformers' GGUF reader drops: the parameters are fitted back, and the model served is HF's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir = tiny_dirs["llama3_rope"]
    path = write_family_gguf(hf_dir, tmp_path / "tiny-llama3.gguf", "llama", default_gguf_path())
    converted = resolve_model_dir(str(path))
    want, got = (
        AutoConfig.from_pretrained(hf_dir).rope_parameters,
        AutoConfig.from_pretrained(converted).rope_parameters,
    )
    for key in (
        "rope_type",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ):
        assert got[key] == pytest.approx(want[key]), key
    hf = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 40, 90)]
    refs = [hf_greedy(hf, p, 8, (2,)) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=128)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_greedy_match(out.outputs[0].token_ids, ref, what=f"llama3 gguf prompt {i}")


# Per family, a tiny model whose attention holds what transformers' GGUF reader drops (or keeps)
# where llama.cpp's files carry it: Mistral's window (a ``llama`` file), Qwen3's key_length (24,
# not 64 / 4 nor Qwen3Config's 128), Gemma 2's soft-capping (not the class's 50 / 30) and
# window, Gemma 3's final soft-capping and window (six layers: llama.cpp's 5:1 pattern, which
# no key holds), Gemma's query_pre_attn_scalar (head_dim, as llama.cpp takes it below 27B; the
# reader keeps 256), Phi-3's window.
ATTENTION_FACTS = {
    "mistral": {},
    "qwen3": {"head_dim": 24},
    "gemma2": {"query_pre_attn_scalar": 16},
    "gemma3": {"layers": 6, "query_pre_attn_scalar": 16, "final_logit_softcapping": 8.0},
    "phi3": {},
}
CONFIG_KEYS = (
    "model_type",
    "head_dim",
    "sliding_window",
    "layer_types",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(ATTENTION_FACTS))
def test_gguf_conversion_keeps_the_attention(
    family: str, tmp_path: Path, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF file (F32, so the weights come back bit for bit) converts to the model it was
    written from: the same config values, the same architecture read by our loader (windows per
    layer, soft-caps, attention scale, head size), and HF's logits over a prompt past the
    32-token window equal those of the folder it came from."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # A cache of its own: the file's bytes are the same every run, and a shared cache would hand
    # back a folder converted by older code.
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path / "cache"))
    hf_dir = make_tiny_family_dir(tmp_path / "hf", smollm2_dir, family, seed=5, **ATTENTION_FACTS[family])
    path = write_family_gguf(
        hf_dir, tmp_path / f"tiny-{family}.gguf", family, default_gguf_path(), quantize=False
    )
    converted = resolve_model_dir(str(path))
    want, got = AutoConfig.from_pretrained(hf_dir), AutoConfig.from_pretrained(converted)
    assert {k: getattr(got, k, None) for k in CONFIG_KEYS} == {k: getattr(want, k, None) for k in CONFIG_KEYS}
    ours, theirs = ModelArch.from_hf_config(load_hf_config(converted)), ModelArch.from_hf_config(want)
    for key in (
        "family",
        "head_dim",
        "layer_windows",
        "attn_scale",
        "attn_logit_softcap",
        "final_logit_softcap",
    ):
        assert getattr(ours, key) == getattr(theirs, key), key

    prompt = torch.tensor([[random.Random(3).randrange(3, 49152) for _ in range(45)]])
    logits = []
    for folder in (hf_dir, converted):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(prompt).logits[0])
    # Gemma's norms went through 1 + w and back: float rounding, far below what a lost value moves.
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def _metadata_gguf(path: Path, arch: str, values: dict[str, tuple[object, str]]) -> tuple[Path, Any]:
    """A GGUF file of ``arch`` with metadata only (``{key: (value, "uint32" | "float32")}``)
    and its reader."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, (value, kind) in values.items():
        getattr(writer, f"add_{kind}")(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, gguf.GGUFReader(str(path))


@pytest.mark.parametrize(("layers", "scalar"), [(46, 144), (26, 256), (4, 256)])
def test_gemma2_attention_scale_is_llama_cpps(tmp_path: Path, layers: int, scalar: int) -> None:
    """No GGUF key holds Gemma's query_pre_attn_scalar: llama.cpp takes hidden / heads for the
    27B (46 layers: 4608 / 32 = 144, head_dim 128) and head_dim for the others, and so do we."""
    from transformers import Gemma2Config

    path, reader = _metadata_gguf(tmp_path / "g.gguf", "gemma2", {})
    head_dim = 128 if layers == 46 else 256
    config = Gemma2Config(
        num_hidden_layers=layers, hidden_size=4608, num_attention_heads=32, head_dim=head_dim
    )
    assert _restore_attention(path, reader, config) is config
    assert config.query_pre_attn_scalar == scalar


def test_gguf_attention_it_cannot_serve_is_refused(tmp_path: Path) -> None:
    """Heads of two sizes, soft-capping on a family without it, a windowed Llama with biases:
    refused by name rather than served as another model."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4)
    two_sizes = {"llama.attention.key_length": (16, "uint32"), "llama.attention.value_length": (32, "uint32")}
    with pytest.raises(ValueError, match="heads of two sizes"):
        _restore_head_dim(*_metadata_gguf(tmp_path / "a.gguf", "llama", two_sizes), config)
    capped = {"llama.final_logit_softcapping": (30.0, "float32")}
    with pytest.raises(ValueError, match="final_logit_softcapping in a llama model"):
        _restore_attention(*_metadata_gguf(tmp_path / "b.gguf", "llama", capped), config)
    windowed = {"llama.attention.sliding_window": (32, "uint32")}
    config.attention_bias = True
    with pytest.raises(ValueError, match="sliding window and biases"):
        _restore_attention(*_metadata_gguf(tmp_path / "c.gguf", "llama", windowed), config)
