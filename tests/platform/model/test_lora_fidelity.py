"""Multi-LoRA fidelity: a batch mixing the base model and 8 adapters gives, for each
request, the greedy tokens HF transformers + PEFT give for that adapter alone.

Adapters have random non-zero A and B, ranks 4-64 mixed, different target modules,
rsLoRA and an alpha pattern. The same requests run with enough slots for every
adapter, with 4x fewer slots than adapters (slots swap during the run), under
chunked prefill, and under KV pressure (preemption).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from support.adapters import make_peft_adapter
from support.fidelity import Reference, assert_greedy_match, hf_greedy

from loraplex import LLM, LoRARequest, SamplingParams

MAX_NEW = 10
ADAPTER_SPECS: list[dict[str, Any]] = [
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    dict(r=16, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    dict(
        r=32,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    dict(r=64, lora_alpha=32, target_modules=["o_proj", "down_proj"]),
    dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "up_proj"]),
    dict(r=16, lora_alpha=16, target_modules=["q_proj", "gate_proj"], alpha_pattern={"gate_proj": 64}),
    dict(r=4, lora_alpha=4, target_modules=["v_proj", "down_proj"], rank_pattern={"down_proj": 12}),
]


@pytest.fixture(scope="module")
def lora_setup(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    base_dir = tiny_dirs["gqa_tied"]
    root = tmp_path_factory.mktemp("adapters")
    rng = random.Random(3)
    loras: list[LoRARequest] = []
    prompts: list[list[int]] = []
    which: list[LoRARequest | None] = []
    refs: list[Reference] = []
    for i, spec in enumerate(ADAPTER_SPECS):
        path = root / f"a{i}"
        peft_model = make_peft_adapter(base_dir, path, seed=100 + i, spec=spec)
        lora = LoRARequest(f"adapter-{i}", i + 1, str(path))
        loras.append(lora)
        for _ in range(3):
            p = [rng.randrange(3, 49152) for _ in range(rng.randint(3, 40))]
            prompts.append(p)
            which.append(lora)
            refs.append(hf_greedy(peft_model, p, MAX_NEW, (2,)))
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    for _ in range(4):
        p = [rng.randrange(3, 49152) for _ in range(rng.randint(3, 40))]
        prompts.append(p)
        which.append(None)
        refs.append(hf_greedy(base, p, MAX_NEW, (2,)))
    # Interleave adapters and base requests so every step mixes them.
    order = list(range(len(prompts)))
    rng.shuffle(order)
    return {
        "base_dir": base_dir,
        "loras": loras,
        "prompts": [prompts[i] for i in order],
        "which": [which[i] for i in order],
        "refs": [refs[i] for i in order],
    }


def _llm(base_dir: Path, **kw: Any) -> LLM:
    args = dict(dtype="float32", enable_lora=True, max_lora_rank=64, num_kv_blocks=256, max_num_seqs=32)
    args.update(kw)
    return LLM(model=str(base_dir), **args)


def _check(llm: LLM, setup: dict[str, Any], what: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    outs = llm.generate(setup["prompts"], params, lora_request=setup["which"], use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, setup["refs"], strict=True)):
        lora = setup["which"][i]
        assert out.error is None, out.error
        assert_greedy_match(out.outputs[0].token_ids, ref, what=f"{what} req {i} ({lora and lora.name})")
    engine = llm.llm_engine
    engine.check_integrity()
    # Every KV block is free again; resident adapters keep the blocks they borrowed.
    counts = engine.kv.block_counts()
    assert counts.num_used_device_blocks == 0
    assert (
        engine.kv.block_manager.num_free_blocks + counts.num_adapter_device_blocks == counts.num_device_blocks
    )
    assert engine.lora_runtime.num_pins == 0, "every adapter pin is released"


@pytest.mark.slow
def test_mixed_batch_all_slots(lora_setup: dict[str, Any]) -> None:
    _check(_llm(lora_setup["base_dir"], max_loras=8), lora_setup, "8 slots")


def test_paged_by_default_every_adapter_resident_at_once(lora_setup: dict[str, Any]) -> None:
    """Engine defaults (no max_loras): ranks 4-64 in pages of 8 rows, all eight adapters in the
    same steps, no rank padding (an adapter's pages follow its own rank)."""
    llm = _llm(lora_setup["base_dir"], max_lora_rank=64)
    _check(llm, lora_setup, "paged, uncapped")
    stats = llm.llm_engine.lora_runtime.adapter_manager.stats()
    assert stats.max_loras is None
    assert stats.num_on_device == len(ADAPTER_SPECS) and stats.num_evictions == 0
    # Pages per group: ceil(rank / 8) for each adapter targeting the group (rank_pattern and
    # all): no padding to max_lora_rank (64), which would be 8 pages per adapter and group.
    want = {"qkv": 1 + 1 + 4 + 1 + 2 + 1, "o": 1 + 4 + 8, "gate_up": 2 + 4 + 1 + 2, "down": 2 + 4 + 8 + 2}
    assert stats.pages_used == want


@pytest.mark.slow
def test_paged_evicts_and_reloads_under_a_small_lora_memory(lora_setup: dict[str, Any]) -> None:
    """A lora_memory of half what the eight adapters take: adapters are evicted (least recently
    used, unpinned) and reloaded into other pages during the run; tokens stay PEFT's."""
    probe = _llm(lora_setup["base_dir"])
    _check(probe, lora_setup, "probe")
    total = probe.llm_engine.lora_runtime.adapter_manager.stats().pool_used_bytes
    del probe
    llm = _llm(lora_setup["base_dir"], lora_memory=total // 2)
    _check(llm, lora_setup, "paged, half the memory")
    stats = llm.llm_engine.lora_runtime.adapter_manager.stats()
    assert stats.num_evictions > 0 and stats.num_slot_loads > len(ADAPTER_SPECS)
    assert stats.pool_bytes <= total // 2


def test_slots_swap_when_adapters_exceed_slots(lora_setup: dict[str, Any]) -> None:
    llm = _llm(lora_setup["base_dir"], max_loras=2, max_cpu_loras=3)
    _check(llm, lora_setup, "2 slots")


def test_lora_under_chunked_prefill(lora_setup: dict[str, Any]) -> None:
    llm = _llm(lora_setup["base_dir"], max_loras=2, max_num_seqs=4, max_num_batched_tokens=7)
    _check(llm, lora_setup, "chunked")


def test_lora_after_preemption(lora_setup: dict[str, Any]) -> None:
    # One pool for KV and adapter pages: the largest adapter alone takes 88 blocks of 8 tokens
    # on the tiny model, leaving the sixteen sequences too little KV, so some are preempted
    # (and idle adapters give their blocks back first).
    llm = _llm(lora_setup["base_dir"], max_loras=3, num_kv_blocks=110, block_size=8, max_num_seqs=16)
    _check(llm, lora_setup, "preempted")
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_remove_adapter_while_in_use(lora_setup: dict[str, Any]) -> None:
    llm = _llm(lora_setup["base_dir"], max_loras=2, max_num_seqs=1)
    engine = llm.llm_engine
    idx = next(i for i, w in enumerate(lora_setup["which"]) if w is not None)
    lora = lora_setup["which"][idx]
    prompt = lora_setup["prompts"][idx]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    engine.add_request("running", prompt, params, lora_request=lora)
    engine.add_request("queued", prompt, params, lora_request=lora)
    outs = {o.request_id: o for o in engine.step()}
    assert "running" in outs and "queued" not in outs
    engine.remove_lora(lora.int_id)
    final: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    # The running request finished on the old weights; the queued one was refused.
    assert_greedy_match(
        final["running"].outputs[0].token_ids, lora_setup["refs"][idx], what="removed mid-run"
    )
    assert final["queued"].outputs[0].finish_reason == "abort"
    assert final["queued"].error is not None and "removed" in final["queued"].error.message
    engine.check_integrity()
    assert engine.lora_runtime.adapter_manager.num_free_slots == 2


def test_lora_request_without_enable_lora(tiny_dirs: dict[str, Path], lora_setup: dict[str, Any]) -> None:
    llm = LLM(model=str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(
            [[5, 6]], SamplingParams(max_tokens=2), lora_request=lora_setup["loras"][0], use_tqdm=False
        )


def test_bad_adapter_rejected_at_add(lora_setup: dict[str, Any], tmp_path: Path) -> None:
    llm = _llm(lora_setup["base_dir"], max_loras=2, max_lora_rank=8)
    big = lora_setup["loras"][4]  # rank 64 > max_lora_rank 8
    with pytest.raises(ValueError, match="rank"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), lora_request=big, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    missing = LoRARequest("ghost", 99, str(tmp_path / "nope"))
    with pytest.raises((ValueError, FileNotFoundError)):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), lora_request=missing, use_tqdm=False)
