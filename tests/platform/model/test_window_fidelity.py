"""Sliding-window models served past the window equal HF transformers (fp32, greedy), while
the block manager frees the blocks the window left behind.

A tiny random Mistral (window 32 tokens, blocks of 8) runs prompts shorter and longer than
the window with generations that cross it: one request alone, a batch, chunked prefill
(7-token budget), a pool so small that sequences are preempted and recomputed (it could not
hold even one whole sequence without the window), and prefix-cache hits whose head blocks
are padded out of the window. A model whose window is ignored would differ from HF here: the
test checks the window changes HF's own output first.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from support.fidelity import Reference, assert_greedy_match, hf_greedy
from support.models import TOKENIZER_FILES

from loraplex import LLM, SamplingParams

WINDOW = 32
MAX_NEW = 40


def _mistral_dir(out_dir: Path, tokenizer_dir: Path, window: int | None, seed: int = 5) -> Path:
    """A randomly initialised HF Mistral with ``sliding_window=window`` (weights widened so
    logits are not near-ties), with SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM, MistralConfig

    torch.manual_seed(seed)
    cfg = MistralConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        sliding_window=window,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.08 if p.dim() == 2 else 0.05)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return _mistral_dir(tmp_path_factory.mktemp("mistral_w32"), smollm2_dir, WINDOW)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 20, 31, 32, 33, 47, 64, 90]
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


def _references(model_dir: Path, prompts: list[list[int]]) -> list[Reference]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return [hf_greedy(model, p, MAX_NEW, (2,)) for p in prompts]


def _run(llm: LLM, prompts: list[list[int]], refs: list[Reference], what: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    engine.check_integrity()
    bm = engine.kv.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_greedy_match(out.outputs[0].token_ids, ref, what=f"{what} prompt {i}")


@pytest.mark.slow
def test_window_changes_the_reference(mistral_dir: Path, tmp_path: Path, smollm2_dir: Path) -> None:
    """The same weights without a window generate otherwise past 32 tokens: so the fidelity
    test below can fail when the window is not applied (or applied one position off)."""
    prompts = _prompts(0)[-2:]
    windowed = _references(mistral_dir, prompts)
    full = _references(_mistral_dir(tmp_path / "full", smollm2_dir, None), prompts)
    assert any(a.tokens != b.tokens for a, b in zip(windowed, full, strict=True))


@pytest.mark.slow
def test_mistral_window_matches_hf_past_the_window(mistral_dir: Path) -> None:
    prompts = _prompts(0)
    refs = _references(mistral_dir, prompts)
    common: dict[str, Any] = dict(model=str(mistral_dir), dtype="float32", block_size=8)

    llm = LLM(**common, num_kv_blocks=64, max_num_seqs=8)
    assert llm.llm_engine.info.max_model_len == 2048  # not capped at the window
    bm = llm.llm_engine.kv.block_manager
    assert bm.sliding_window == WINDOW and bm.window_step_blocks == 5
    _run(llm, prompts[7:], refs[7:], "single")
    # 130 tokens = 17 blocks without a window; the window freed all but the last few.
    assert bm.num_window_freed_blocks >= 17 - 5
    _run(llm, prompts, refs, "batch")

    # Chunked prefill: a 7-token budget crosses the window inside prompts and chunks.
    chunked = LLM(**common, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=7)
    _run(chunked, prompts, refs, "chunked")

    # 12 blocks of 8 = 96 tokens: less than one 130-token sequence, and 8 of them share it.
    tight = LLM(**common, num_kv_blocks=12, max_num_seqs=8, max_num_batched_tokens=64)
    _run(tight, prompts, refs, "preempted")
    assert tight.llm_engine.scheduler.num_preemptions > 0, "the tight pool was meant to preempt"


def test_prefix_hits_past_the_window_match_hf(mistral_dir: Path) -> None:
    """A second run of the same prompts hits the prefix cache: its head blocks (out of the
    window) are padded, the window's blocks shared. Tokens still equal HF's."""
    prompts = _prompts(1)[4:]
    refs = _references(mistral_dir, prompts)
    llm = LLM(
        model=str(mistral_dir),
        dtype="float32",
        block_size=8,
        num_kv_blocks=128,
        max_num_seqs=4,
        enable_prefix_caching=True,
    )
    _run(llm, prompts, refs, "cold")
    _run(llm, prompts, refs, "warm")
    stats = llm.llm_engine.kv.block_manager.prefix_cache_stats()
    assert stats.num_hit_blocks > 0


@pytest.mark.slow
def test_tight_pool_with_host_tier_and_swap_matches_hf(mistral_dir: Path) -> None:
    """Preemption with swap (the partial tail to the host tier), evictions demoting blocks freed
    out of the window, promotions of prefixes: all with PAD entries in the tables."""
    prompts = _prompts(2)
    refs = _references(mistral_dir, prompts)
    llm = LLM(
        model=str(mistral_dir),
        dtype="float32",
        block_size=8,
        num_kv_blocks=12,
        max_num_seqs=8,
        enable_prefix_caching=True,
        host_kv_cache_bytes=4 << 20,
        preemption_mode="swap",
    )
    _run(llm, prompts, refs, "tiered cold")
    _run(llm, prompts, refs, "tiered warm")
    sched = llm.llm_engine.scheduler
    assert sched.num_preemptions > 0 and sched.num_swapped_out > 0


@pytest.mark.timeout(120)
def test_prompt_longer_than_the_pool_with_its_prefix_in_the_host_tier(mistral_dir: Path) -> None:
    """A 120-token prompt (15 blocks) in a 12-block pool, its blocks demoted to the host tier by
    other requests: its prefix hit and the host run could never be held at once, so admission
    computes past the device hit instead of waiting for room (it used to wait forever)."""
    rng = random.Random(9)
    prompt = [rng.randrange(3, 49152) for _ in range(120)]
    others = [[rng.randrange(3, 49152) for _ in range(90)] for _ in range(3)]
    refs = _references(mistral_dir, [prompt])
    llm = LLM(
        model=str(mistral_dir),
        dtype="float32",
        block_size=8,
        num_kv_blocks=12,
        max_num_seqs=4,
        enable_prefix_caching=True,
        host_kv_cache_bytes=4 << 20,
    )
    _run(llm, [prompt], refs, "long prompt cold")
    llm.generate(others, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    host, _disk = llm.llm_engine.kv.tier_metrics()
    assert host.demotions > 0
    _run(llm, [prompt], refs, "long prompt, prefix in the host tier")


@pytest.mark.slow
@pytest.mark.parametrize("max_window_layers", [0, 1])
def test_qwen2_sliding_window_matches_hf(max_window_layers: int, tmp_path: Path, smollm2_dir: Path) -> None:
    """Qwen2 with ``use_sliding_window``: all layers windowed (blocks freed), or the first
    ``max_window_layers`` global (a mixed model: nothing freed, each layer its own window)."""
    from support.models import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "qwen2", smollm2_dir, model_type="qwen2", kv_heads=2, seed=6)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=max_window_layers)
    config.pop("layer_types", None)  # derived again from max_window_layers on load
    config_path.write_text(json.dumps(config))
    prompts = _prompts(3)[3:]
    refs = _references(model_dir, prompts)
    llm = LLM(model=str(model_dir), dtype="float32", block_size=8, num_kv_blocks=64, max_num_seqs=4)
    _run(llm, prompts, refs, f"qwen2 max_window_layers={max_window_layers}")
    bm = llm.llm_engine.kv.block_manager
    if max_window_layers == 0:
        assert bm.sliding_window == WINDOW and bm.num_window_freed_blocks > 0
    else:
        assert bm.sliding_window is None and bm.num_window_freed_blocks == 0
    # What /metrics exports (loraplex_kv_window_freed_blocks_total) is the manager's count.
    assert llm.llm_engine.stats.kv.num_window_freed_blocks == bm.num_window_freed_blocks
