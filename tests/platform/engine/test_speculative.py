"""Speculative decoding (prompt lookup): greedy tokens exactly those without it (and HF's), in
mixed batches with chunked prefill, preemption and LoRA; sampled tokens keep the target
distribution; the pool stays consistent after every step."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from support.speculation import copy_prompt, random_workload, run_checked

from loraplex import LLM, SamplingParams
from loraplex.platform.engine.speculative import SpeculativeConfig, ngram_propose, verify

SPEC: dict[str, Any] = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": None,  # on in every batch here: the mixed batches are the point
}


def test_ngram_propose() -> None:
    assert ngram_propose([5, 6, 7, 8, 5, 6], 3, 1, 3) == [7, 8, 5]
    assert ngram_propose([1, 2, 3], 2, 1, 3) == []
    assert ngram_propose([9, 4, 9, 4, 9], 2, 1, 2) == [4, 9]  # the latest match
    assert ngram_propose([7, 1, 2, 7], 4, 1, 1) == [1, 2, 7]


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig.parse({"method": "draft_model"})
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_token": 3})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.parse('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}')
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 2}').num_speculative_tokens == 2


@pytest.mark.slow
def test_rejection_sampling_keeps_distribution() -> None:
    """Chi-square: tokens from ``verify`` with a fixed (often wrong) draft follow p exactly."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]] * 2)
    p = logits[0].softmax(-1)
    params = SamplingParams(temperature=1.0)
    n = 2000
    for draft in (0, 3):  # a likely and an unlikely draft
        counts = torch.zeros(6)
        for _ in range(n):
            tokens, _ = verify(logits, [draft], params, gen)
            counts[tokens[0]] += 1
        expected = p * n
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 20.5, (
            f"draft {draft}: chi2 {chi2:.1f} (df 5, p=0.001 at 20.5); counts {counts.tolist()}"
        )


def _llm(model: Path, spec: dict[str, Any] | None, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(
        dtype="float32", num_kv_blocks=96, block_size=8, max_num_batched_tokens=32, max_num_seqs=16
    )
    args.update(kw)
    return LLM(model=str(model), speculative_config=spec, **args)


@pytest.mark.slow
def test_greedy_equals_no_spec_and_hf(tiny_dirs: dict[str, Path]) -> None:
    from support.fidelity import assert_greedy_match, hf_greedy
    from transformers import AutoModelForCausalLM

    model = tiny_dirs["mha_untied"]
    prompts = [copy_prompt(s) for s in range(6)] + [[1, 77, 78, 79, 80, 81, 82]]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in prompts]
    plain = run_checked(_llm(model, None), prompts, params)
    spec_llm = _llm(model, SPEC)
    spec = run_checked(spec_llm, prompts, params)
    assert spec == plain
    counters = spec_llm.llm_engine.speculator.counters  # type: ignore[union-attr]
    assert counters.num_draft_tokens > 0 and counters.num_accepted_tokens > 0
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for prompt, ours in zip(prompts[:2], spec, strict=False):
        assert_greedy_match(ours, hf_greedy(hf, prompt, 24, (2,)), what="spec vs HF")


@pytest.mark.slow
def test_greedy_with_preemption_and_mixed_sampling(tiny_dirs: dict[str, Path]) -> None:
    """A tight pool (preemption, recompute) and a batch mixing greedy and seeded sampled requests."""
    model = tiny_dirs["gqa_tied"]
    prompts = [copy_prompt(s, 32) for s in range(8)]
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    plain = run_checked(_llm(model, None, num_kv_blocks=24), prompts, params)
    tight = _llm(model, SPEC, num_kv_blocks=24)
    spec = run_checked(tight, prompts, params)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    for i in range(0, len(prompts), 2):
        assert spec[i] == plain[i], f"greedy request {i} differs"
    for i in range(1, len(prompts), 2):
        assert len(spec[i]) == 20


@pytest.mark.slow
def test_greedy_with_lora(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    from support.adapters import make_peft_adapter

    from loraplex import LoRARequest

    model = tiny_dirs["mha_untied"]
    adapter = tmp_path / "lora"
    make_peft_adapter(
        model, adapter, seed=3, spec=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    lora = LoRARequest("a", 1, str(adapter))
    prompts = [copy_prompt(s) for s in range(3)]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = []
    for spec in (None, SPEC):
        llm = _llm(model, spec, enable_lora=True)
        res = llm.generate(prompts, sp, lora_request=[lora, None, lora], use_tqdm=False)
        outs.append([r.outputs[0].token_ids for r in res])
    assert outs[0] == outs[1]


def test_random_workload_invariants(tiny_dirs: dict[str, Path]) -> None:
    """Speculation, parallel sampling, aborts and preemption at random: the pool is consistent
    after every step, and every surviving request finishes."""
    llm = _llm(tiny_dirs["gqa_tied"], SPEC, num_kv_blocks=20, enable_prefix_caching=True)
    random_workload(llm, seed=7, steps=150, max_new=24)
    engine = llm.llm_engine
    assert engine.speculator is not None and engine.speculator.counters.num_drafts > 0


def test_metrics_in_vllm_dialect_and_per_request(tiny_dirs: dict[str, Path]) -> None:
    """/metrics' collector shows vLLM's spec_decode counters, equal to the engine's; each request
    carries its own proposed / accepted counts."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from loraplex.platform.api.observability.vllm_metrics import VLLMCollector
    from loraplex.platform.engine.async_engine import AsyncEngine

    llm = _llm(tiny_dirs["mha_untied"], SPEC)
    outs = llm.generate(
        [copy_prompt(s) for s in range(3)], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False
    )
    engine = llm.llm_engine
    counters = engine.speculator.counters  # type: ignore[union-attr]
    assert sum(int(o.metrics.get("spec_num_draft_tokens", 0)) for o in outs) == counters.num_draft_tokens
    assert (
        sum(int(o.metrics.get("spec_num_accepted_tokens", 0)) for o in outs) == counters.num_accepted_tokens
    )
    engine.publish_stats()
    async_engine = AsyncEngine(engine)
    try:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(VLLMCollector(async_engine, "m", 0.9, True))
        families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    finally:
        async_engine.shutdown()
    value = {
        name: families[name].samples[0].value for name in families if name.startswith("vllm:spec_decode")
    }
    assert families["vllm:spec_decode_num_draft_tokens"].type == "counter"
    assert value["vllm:spec_decode_num_draft_tokens"] == counters.num_draft_tokens > 0
    assert value["vllm:spec_decode_num_accepted_tokens"] == counters.num_accepted_tokens
    assert value["vllm:spec_decode_num_drafts"] == counters.num_drafts
    per_pos = families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
    assert sum(s.value for s in per_pos if s.name.endswith("_total")) == counters.num_accepted_tokens


def test_beams_then_speculation_on_one_pool(tiny_dirs: dict[str, Path]) -> None:
    """Beam searches (one aborted midway, preemption in a tight pool) and speculative requests
    take turns on one engine: the pool is consistent after every step and empty at the end.
    (A beam search needs an idle engine, so the two do not share a step.)"""
    from loraplex import BeamSearchParams
    from loraplex.platform.engine.beam_search import BeamSearch

    llm = _llm(tiny_dirs["gqa_tied"], SPEC, num_kv_blocks=10)
    engine = llm.llm_engine
    rng = random.Random(3)
    for round_ in range(3):
        prompts: list[str | list[int]] = [copy_prompt(rng.randrange(9), 12) for _ in range(2)]
        search = BeamSearch(engine, prompts, BeamSearchParams(beam_width=4, max_tokens=12))
        stop_at = rng.randrange(2, 8) if round_ == 1 else None
        steps = 0
        while not search.finished:
            search.step()
            engine.check_integrity()
            steps += 1
            if steps == stop_at:
                search.abort()
                engine.check_integrity()
        assert not engine.has_unfinished_requests()
        sp = SamplingParams(max_tokens=16, temperature=rng.choice([0.0, 1.0]), ignore_eos=True)
        run_checked(llm, [copy_prompt(rng.randrange(9), 16) for _ in range(3)], [sp] * 3)
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.block_manager.num_free_blocks == engine.kv.block_manager.num_blocks
