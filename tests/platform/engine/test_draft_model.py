"""Speculative decoding with a draft model: greedy tokens exactly those without it (and HF's), in
mixed batches with chunked prefill, preemption, LoRA and a draft KV pool too small for everyone;
the draft's KV follows its sequence (a model drafting for itself is accepted almost always)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.drafts import make_layer_draft
from support.models import make_tiny_model_dir
from support.speculation import copy_prompt, random_workload, run_checked

from loraplex import LLM, SamplingParams
from loraplex.platform.engine.draft_model import DraftModelProposer
from loraplex.platform.engine.speculative import SpeculativeConfig


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_model_dir(root / "target", smollm2_dir, layers=4, heads=4, kv_heads=2, seed=5)
    _quieten_top_layers(target, keep=2, scale=0.3)
    return {"target": target, "draft": make_layer_draft(target, root / "draft", 2)}


def _quieten_top_layers(model_dir: Path, keep: int, scale: float) -> None:
    """Scale the residual writes of the layers past ``keep``: the first ``keep`` layers then agree
    with the whole model often but not always, as a trained model's early layers do (a random
    model's last layers would change every argmax)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers[keep:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    model.save_pretrained(model_dir, safe_serialization=True)


def _spec(draft: Path, **kw: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": str(draft),  # no method: vLLM reads a named model as method draft_model
        "num_speculative_tokens": 3,
        "disable_by_batch_size": None,  # on in every batch here: the mixed batches are the point
        "draft_policy": "always",  # k drafts every step: the draft KV's bookkeeping is the point
    }
    spec.update(kw)
    return spec


def _llm(model: Path, spec: dict[str, Any] | None, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(
        dtype="float32", num_kv_blocks=96, block_size=8, max_num_batched_tokens=32, max_num_seqs=16
    )
    args.update(kw)
    return LLM(model=str(model), speculative_config=spec, **args)


def _proposer(llm: LLM) -> DraftModelProposer:
    speculator = llm.llm_engine.speculator
    assert speculator is not None and isinstance(speculator.proposer, DraftModelProposer)
    return speculator.proposer


def test_config() -> None:
    cfg = SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2})
    assert cfg.method == "draft_model" and cfg.model == "/m"
    assert cfg.draft_policy == "always" and cfg.disable_by_batch_size == 4  # a draft model's defaults
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig.parse({"method": "draft_model"})
    with pytest.raises(ValueError, match="'model' is for method 'draft_model'"):
        SpeculativeConfig.parse({"method": "ngram", "model": "/m"})
    with pytest.raises(ValueError, match="num_draft_kv_blocks"):
        SpeculativeConfig.parse({"model": "/m", "num_draft_kv_blocks": 0})


def test_a_model_drafting_for_itself_is_accepted_and_exact(models: dict[str, Path]) -> None:
    """The target as its own draft: every greedy draft should be the target's token, so acceptance
    near 1 shows the draft KV follows each sequence through verification and rollback; the tokens
    equal those without speculation, in batches mixing prefill chunks and decodes."""
    target = models["target"]
    prompts = [copy_prompt(s) for s in range(4)] + [copy_prompt(9, 30, copy=False), [1, 77, 78]]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True) for _ in prompts]
    plain = run_checked(_llm(target, None), prompts, params)
    llm = _llm(target, _spec(target))
    assert run_checked(llm, prompts, params) == plain
    counters = llm.llm_engine.speculator.counters  # type: ignore[union-attr]
    assert counters.num_draft_tokens > 40
    assert counters.num_accepted_tokens >= 0.9 * counters.num_draft_tokens, counters
    proposer = _proposer(llm)
    assert proposer.num_free_blocks == proposer.num_blocks  # every finished sequence gave its back


@pytest.mark.slow
def test_layer_draft_greedy_equals_plain_and_hf(models: dict[str, Path]) -> None:
    from support.fidelity import assert_greedy_match, hf_greedy
    from transformers import AutoModelForCausalLM

    target, draft = models["target"], models["draft"]
    prompts = [copy_prompt(s) for s in range(5)] + [copy_prompt(11, 20, copy=False)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in prompts]
    plain = run_checked(_llm(target, None), prompts, params)
    llm = _llm(target, _spec(draft))
    spec = run_checked(llm, prompts, params)
    assert spec == plain
    counters = llm.llm_engine.speculator.counters  # type: ignore[union-attr]
    assert counters.num_draft_tokens > 0 and counters.num_accepted_tokens > 0
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for prompt, ours in zip(prompts[:2], spec, strict=False):
        assert_greedy_match(ours, hf_greedy(hf, prompt, 24, (2,)), what="draft spec vs HF")


def test_drafts_are_the_draft_models_own_greedy_tokens(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each proposal equals HF's greedy continuation of the draft model over the sequence's tokens
    at that step: the draft KV kept across steps (rolled back after each rejection, evicted and
    rebuilt when its pool is short) holds exactly what a fresh run would compute."""
    from support.fidelity import assert_greedy_match, hf_greedy
    from transformers import AutoModelForCausalLM

    target, draft = models["target"], models["draft"]
    llm = _llm(target, _spec(draft, num_draft_kv_blocks=14))
    proposer = _proposer(llm)
    records: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose

    def recording(wants: list[tuple[Any, int]]) -> dict[int, list[int]]:
        before = [list(seq.token_ids) for seq, _ in wants]
        drafts = propose(wants)
        records.extend(
            (tokens, drafts[seq.seq_id])
            for tokens, (seq, _) in zip(before, wants, strict=True)
            if seq.seq_id in drafts
        )
        return drafts

    monkeypatch.setattr(proposer, "propose", recording)
    prompts = [copy_prompt(s, 24) for s in range(3)] + [copy_prompt(5, 16, copy=False)]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True) for _ in prompts]
    run_checked(llm, prompts, params)
    counters = llm.llm_engine.speculator.counters  # type: ignore[union-attr]
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens  # rejections happened
    hf = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    assert len(records) > 10
    for tokens, drafts in records:
        assert_greedy_match(
            drafts, hf_greedy(hf, tokens, len(drafts), (-1,)), what=f"draft after {len(tokens)}"
        )


@pytest.mark.slow
def test_preemption_sampling_and_a_small_draft_pool(models: dict[str, Path]) -> None:
    """A tight target pool (preemption, recompute), greedy and seeded sampled requests, and a draft
    pool of 12 blocks for 8 sequences of 5-7 blocks each (draft KV evicted, some steps without
    drafts): greedy tokens unchanged, sampled requests run to their length, pools consistent."""
    target, draft = models["target"], models["draft"]
    prompts = [copy_prompt(s, 32) for s in range(8)]
    params = [
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(max_tokens=16, temperature=0.8, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    plain = run_checked(_llm(target, None, num_kv_blocks=24), prompts, params)
    llm = _llm(target, _spec(draft, num_draft_kv_blocks=12), num_kv_blocks=24)
    spec = run_checked(llm, prompts, params)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for i in range(0, len(prompts), 2):
        assert spec[i] == plain[i], f"greedy request {i} differs"
    for i in range(1, len(prompts), 2):
        assert len(spec[i]) == 16
    counters = llm.llm_engine.speculator.counters  # type: ignore[union-attr]
    assert counters.num_accepted_tokens > 0
    proposer = _proposer(llm)
    assert proposer.num_free_blocks == proposer.num_blocks


@pytest.mark.slow
def test_greedy_with_lora(models: dict[str, Path], tmp_path: Path) -> None:
    """Requests with and without an adapter in one batch: the draft runs the base weights, the
    target verifies with each request's adapter, so the tokens are the adapter's."""
    from support.adapters import make_peft_adapter

    from loraplex import LoRARequest

    target, draft = models["target"], models["draft"]
    adapter = tmp_path / "lora"
    make_peft_adapter(
        target, adapter, seed=3, spec=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    lora = LoRARequest("a", 1, str(adapter))
    prompts = [copy_prompt(s) for s in range(3)]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = []
    for spec in (None, _spec(draft)):
        llm = _llm(target, spec, enable_lora=True)
        res = llm.generate(prompts, sp, lora_request=[lora, None, lora], use_tqdm=False)
        outs.append([r.outputs[0].token_ids for r in res])
    assert outs[0] == outs[1]


def test_random_workload_invariants(models: dict[str, Path]) -> None:
    """Draft-model speculation, parallel sampling, aborts and preemption at random: both pools are
    consistent after every step and every surviving request finishes."""
    llm = _llm(models["target"], _spec(models["draft"], num_draft_kv_blocks=16), num_kv_blocks=20)
    random_workload(llm, seed=7, steps=120, max_new=20)
    engine = llm.llm_engine
    assert engine.speculator is not None and engine.speculator.counters.num_drafts > 0
    proposer = _proposer(llm)
    assert proposer.num_free_blocks == proposer.num_blocks


def test_a_draft_of_another_vocabulary_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens"):
        _llm(models["target"], _spec(tmp_path / "other"))


def test_a_failing_draft_forward_costs_only_its_drafts(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft's forward raises on some steps: those steps decode without drafts, every request
    still gets its exact greedy tokens, and the draft KV of the sequences concerned is dropped."""
    target = models["target"]
    prompts = [copy_prompt(s) for s in range(3)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True) for _ in prompts]
    plain = run_checked(_llm(target, None), prompts, params)
    llm = _llm(target, _spec(target))
    proposer = _proposer(llm)
    forward = proposer.runner.logits_for
    calls = 0

    def flaky(*args: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls % 3 == 0:
            raise RuntimeError("draft forward failed")
        return forward(*args, **kw)

    monkeypatch.setattr(proposer.runner, "logits_for", flaky)
    assert run_checked(llm, prompts, params) == plain
    assert calls > 6
    assert proposer.num_free_blocks == proposer.num_blocks
