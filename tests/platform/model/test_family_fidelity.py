"""Every model family against HF transformers (fp32, greedy) on tiny random models, base and LoRA.

Each family's tiny model (``support.models.family_config``) has the family's parts switched on: a
32-token sliding window (Qwen2 on its upper layer, Mistral and Phi-3 on every layer, Gemma on
its local layers), Gemma 2's attention and final logit soft-capping, Gemma 3's two RoPE
bases, Phi-3's fused projections and LongRoPE. Prompts are shorter than, as long as and
longer than the window; the same prompts run batched, with a token budget that chunks every
prefill, with a KV pool so small that requests are preempted and recomputed, and on the
portable (torch) kernels. Then a PEFT adapter per family, on the family's own module names
(Phi-3: ``qkv_proj``, ``gate_up_proj``), against PEFT.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from support.adapters import make_peft_adapter
from support.fidelity import Reference, assert_greedy_match, hf_greedy
from support.models import FAMILY_WINDOW, make_tiny_family_dir

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.errors import AdapterValidationError
from loraplex.adapters.peft_config import LoraSettings
from loraplex.adapters.peft_weights import parse_weights
from loraplex.adapters.spec import BaseModelSpec
from loraplex.platform.model.arch import ModelArch

FAMILIES = ["qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "phi4_mini"]
MAX_NEW = 10
W = FAMILY_WINDOW


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: make_tiny_family_dir(root / f, smollm2_dir, f, seed=11 + i) for i, f in enumerate(FAMILIES)}


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 5, W - 1, W, W + 1, 2 * W + 6, rng.randint(2, 80), rng.randint(40, 80)]
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


def _hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _check(llm: LLM, prompts: list[list[int]], refs: list[Reference], what: str, lora: Any = None) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert out.error is None, out.error
        assert_greedy_match(
            out.outputs[0].token_ids, ref, what=f"{what} prompt {i} ({len(prompts[i])} tokens)"
        )
    llm.llm_engine.check_integrity()


@pytest.mark.slow
def test_family_arch_parts(family_dirs: dict[str, Path]) -> None:
    """The arch read from each config has the parts the tiny models switch on."""
    from loraplex.platform.model.loader import load_hf_config

    arch = {f: ModelArch.from_hf_config(load_hf_config(d)) for f, d in family_dirs.items()}
    assert arch["qwen2"].qkv_bias and arch["qwen2"].layer_windows == (None, W)
    assert arch["qwen3"].qk_norm and not arch["qwen3"].qkv_bias
    assert arch["mistral"].layer_windows == (W, W)
    g2 = arch["gemma2"]
    assert g2.layer_windows == (W, None) and g2.attn_logit_softcap == 3.0 and g2.final_logit_softcap == 8.0
    assert g2.gemma_norms and g2.activation == "gelu_tanh" and g2.attn_scale == 24**-0.5
    g3 = arch["gemma3"]
    assert g3.qk_norm and len(g3.ropes) == 2 and g3.layer_ropes == (0, 1)
    assert arch["phi3"].fused_checkpoint and arch["phi3"].ropes[0].long_inv_freq is not None
    assert arch["phi3"].rotary_dim is None  # the whole head turns
    phi4 = arch["phi4_mini"]  # 3/4 of each 16-wide head turns, with LongRoPE frequencies over those 12
    assert phi4.rotary_dim == 12 and phi4.ropes[0].inv_freq is not None and len(phi4.ropes[0].inv_freq) == 6
    # The window no longer caps the context.
    assert arch["mistral"].max_position_embeddings == 2048


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_hf(family: str, family_dirs: dict[str, Path]) -> None:
    model_dir = family_dirs[family]
    prompts = _prompts(FAMILIES.index(family))
    hf = _hf(model_dir)
    refs = [hf_greedy(hf, p, MAX_NEW, (2,)) for p in prompts]

    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128, max_num_seqs=16)
    _check(llm, prompts, refs, f"{family} batch")
    # Logprobs too: a monotone final soft-cap (Gemma 2) leaves greedy tokens alone but not these.
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)
    for prompt, ref, out in zip(prompts, refs, llm.generate(prompts, params, use_tqdm=False), strict=True):
        comp = out.outputs[0]
        for j, tok in enumerate(comp.token_ids[: len(ref.tokens)]):
            if tok != ref.tokens[j]:
                break  # a near tie (checked above): the continuations differ
            got, want = comp.logprobs[j][tok].logprob, float(ref.step_logprobs[j][tok])
            assert abs(got - want) < 1e-3, f"{family} prompt of {len(prompt)}: logprob {j} {got} vs {want}"
    chunked = LLM(
        model=str(model_dir), dtype="float32", num_kv_blocks=128, max_num_seqs=4, max_num_batched_tokens=7
    )
    _check(chunked, prompts, refs, f"{family} chunked")
    tight = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=16, block_size=8, max_num_seqs=8)
    _check(tight, prompts, refs, f"{family} preempted")
    assert tight.llm_engine.scheduler.num_preemptions > 0, "the tight pool was meant to force preemption"
    portable = LLM(
        model=str(model_dir),
        dtype="float32",
        num_kv_blocks=128,
        attention_backend="torch",
        linear_backend="torch",
    )
    _check(portable, prompts, refs, f"{family} torch kernels")


def _adapter_spec(family: str) -> dict[str, Any]:
    if family in ("phi3", "phi4_mini"):
        modules = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    else:
        modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return dict(r=8, lora_alpha=16, target_modules=modules)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_lora_matches_peft(family: str, family_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = family_dirs[family]
    peft_model = make_peft_adapter(model_dir, tmp_path / "adapter", seed=5, spec=_adapter_spec(family))
    base = _hf(model_dir)
    prompts = _prompts(100 + FAMILIES.index(family))[2:]
    lora = LoRARequest(f"{family}-adapter", 1, str(tmp_path / "adapter"))
    which = [lora if i % 3 else None for i in range(len(prompts))]
    refs = [
        hf_greedy(peft_model if w else base, p, MAX_NEW, (2,)) for p, w in zip(prompts, which, strict=True)
    ]
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enable_lora=True,
        max_lora_rank=16,
        num_kv_blocks=128,
        max_num_seqs=8,
        max_num_batched_tokens=24,
    )
    _check(llm, prompts, refs, f"{family} lora", lora=which)


def _lora_tensors(module: str, parent: str, rank: int, in_f: int, out_f: int) -> dict[str, torch.Tensor]:
    key = f"base_model.model.model.layers.0.{parent}.{module}"
    return {
        f"{key}.lora_A.weight": torch.randn(rank, in_f) * 0.1,
        f"{key}.lora_B.weight": torch.randn(out_f, rank) * 0.1,
    }


def test_adapter_modules_checked_against_the_served_family(family_dirs: dict[str, Path]) -> None:
    from loraplex.platform.model.loader import load_hf_config

    phi3 = BaseModelSpec.from_hf_config(load_hf_config(family_dirs["phi3"]))
    qwen3 = BaseModelSpec.from_hf_config(load_hf_config(family_dirs["qwen3"]))
    settings = LoraSettings(
        r=4, lora_alpha=8, use_rslora=False, rank_pattern={}, alpha_pattern={}, target_modules=""
    )
    hidden, q_out = phi3.q_proj
    fused_out = phi3.fused_features("qkv_proj")[1]
    # Phi-3 takes its fused qkv_proj, split into the three slices sharing A.
    weights = parse_weights(
        _lora_tensors("qkv_proj", "self_attn", 4, hidden, fused_out), settings, phi3, 16, torch.float32, "t"
    )
    assert sorted(m for _, m in weights.modules) == ["k_proj", "q_proj", "v_proj"]
    assert weights.modules[(0, "q_proj")].lora_b.shape == (q_out, 4)
    # A Llama-style q_proj does not exist in Phi-3; a fused qkv_proj does not exist in Qwen3.
    with pytest.raises(AdapterValidationError, match="does not have"):
        parse_weights(
            _lora_tensors("q_proj", "self_attn", 4, hidden, q_out), settings, phi3, 16, torch.float32, "t"
        )
    with pytest.raises(AdapterValidationError, match="does not have"):
        parse_weights(
            _lora_tensors("qkv_proj", "self_attn", 4, hidden, fused_out),
            settings,
            qwen3,
            16,
            torch.float32,
            "t",
        )
    # Shapes are the served family's: a gate_up_proj with qkv_proj's rows does not fit Phi-3.
    with pytest.raises(AdapterValidationError, match="do not fit"):
        parse_weights(
            _lora_tensors("gate_up_proj", "mlp", 4, hidden, fused_out), settings, phi3, 16, torch.float32, "t"
        )
