"""GGUF files of every family: a tiny model written with the ``gguf`` package (``support.models``,
Q8_0 projections, the tokenizer and chat template of the bundled SmolLM2 file) is served as a
file, its blocks kept packed (``quantization="auto"``), and gives HF transformers' greedy tokens
on the same weights (the directory transformers' GGUF reader de-quantised them into). The chat
template served is the file's, unchanged.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from support.fidelity import assert_greedy_match, hf_greedy
from support.models import make_tiny_family_dir, write_family_gguf

from loraplex import LLM, SamplingParams
from loraplex.kernels.contracts import PackedWeight
from loraplex.platform.model.source import default_gguf_path, resolve_model_dir

FAST = ["phi3", "phi4_mini"]  # fused projections, LongRoPE factors as tensors, a partial rotary
SLOW = ["gemma2", "qwen2", "qwen3", "mistral", "gemma3"]  # run in CI (-m slow), ~15-20 s each


def _check_family(family: str, root: Path, smollm2_dir: Path) -> None:
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # transformers reads no key_length for Qwen3 GGUF files (its head_dim stays 128): use 128.
    extra = {"head_dim": 128} if family == "qwen3" else {}
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
