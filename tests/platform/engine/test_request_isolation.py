"""One request's failure is that request's alone: refusals at add time, failed steps, bad logits.

Every test runs the real engine on a tiny random model; faults are injected for real
(poisoned adapter weights in the slot buffers, a forward that raises once), never by
replacing the engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.adapters import make_peft_adapter

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.errors import InvalidParameterError, RequestTooLargeError
from loraplex.platform.engine.outputs import RequestOutput

PROMPT = [5, 6, 7, 8, 9]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> LoRARequest:
    path = tmp_path_factory.mktemp("isolation") / "a"
    spec = dict(r=4, target_modules=["q_proj", "v_proj"])
    make_peft_adapter(tiny_dirs["gqa_tied"], path, seed=7, spec=spec)
    return LoRARequest("iso", 1, str(path))


@pytest.fixture()
def engine(tiny_dirs: dict[str, Path]) -> LLMEngine:
    llm = LLM(
        model=str(tiny_dirs["gqa_tied"]),
        dtype="float32",
        num_kv_blocks=64,
        max_num_seqs=4,
        max_model_len=128,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    return llm.llm_engine


def _drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    final: dict[str, RequestOutput] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError("engine did not drain")


def _alone(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request("alone", prompt, GREEDY)
    return _drain(engine)["alone"].outputs[0].token_ids


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prompt", "params", "param", "error"),
    [
        (PROMPT, SamplingParams(n=5), "n", RequestTooLargeError),  # > max_num_seqs: never admitted
        (PROMPT, SamplingParams(max_tokens=124), "max_tokens", RequestTooLargeError),  # 5 + 124 > 128
        ([5] * 128, SamplingParams(max_tokens=1), "prompt", RequestTooLargeError),
        (PROMPT, SamplingParams(logprobs=21), "logprobs", InvalidParameterError),  # > max_logprobs
        (PROMPT, SamplingParams(stop_token_ids=[10**9]), "stop_token_ids", InvalidParameterError),
        ([True, 5], SamplingParams(), "prompt", InvalidParameterError),
        ([10**7], SamplingParams(), "prompt", InvalidParameterError),
        ("\ud800 lone surrogate", SamplingParams(), "prompt", InvalidParameterError),
    ],
)
def test_requests_that_can_never_run_are_refused_at_add(
    engine: LLMEngine, prompt: str | list[int], params: SamplingParams, param: str, error: type[Exception]
) -> None:
    free = engine.kv.block_manager.num_free_blocks
    with pytest.raises(error) as info:
        engine.add_request("bad", prompt, params)
    assert isinstance(info.value, InvalidParameterError) and info.value.param == param
    assert not engine.has_unfinished_requests() and engine.kv.block_manager.num_free_blocks == free
    # ... and the queue is not blocked: the next request runs at once.
    assert len(_alone(engine, PROMPT)) == 8


def test_seeds_of_forked_siblings_never_overflow(engine: LLMEngine) -> None:
    engine.add_request("big-seed", PROMPT, SamplingParams(n=3, seed=2**64 - 1, max_tokens=3))
    out = _drain(engine)["big-seed"]
    assert [len(c.token_ids) for c in out.outputs] == [3, 3, 3] and out.error is None


def test_a_failed_step_fails_only_its_requests(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _alone(engine, PROMPT)
    engine.add_request("victim-1", PROMPT, GREEDY)
    engine.add_request("victim-2", [9, 8, 7], GREEDY)
    engine.step()
    model = engine.runner.model
    original = model.compute_logits
    calls = {"n": 0}

    def fail_once(hidden: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device fault")
        return original(hidden)

    monkeypatch.setattr(model, "compute_logits", fail_once)
    outs = {o.request_id: o for o in engine.step()}  # must not raise
    assert set(outs) == {"victim-1", "victim-2"}
    for out in outs.values():
        assert out.finished and out.error is not None and "injected device fault" in out.error.message
        assert out.outputs[0].finish_reason == "abort"
    assert engine.kv.block_manager.num_free_blocks == engine.kv.block_manager.num_blocks
    engine.check_integrity()
    # The engine goes on serving, with the same tokens as before the fault.
    assert _alone(engine, PROMPT) == expected


def test_non_finite_logits_fail_only_that_request(engine: LLMEngine, adapter: LoRARequest) -> None:
    expected = _alone(engine, PROMPT)
    assert engine.lora_runtime is not None
    engine.add_request("healthy", PROMPT, GREEDY)
    engine.add_request("poisoned", [9, 8, 7], GREEDY, lora_request=adapter)
    engine.step()  # both admitted; the adapter is in a slot now
    runtime = engine.lora_runtime
    slot = runtime.adapter_manager.slot_of(adapter.int_id)
    assert slot is not None
    # An adapter that overflows: its slot's B turns into inf in the first layer.
    _a, b, _scales, _sizes = runtime.adapter_manager.get_buffers(0, "qkv")
    b[:, slot].fill_(float("inf"))
    final = _drain(engine)
    assert final["poisoned"].error is not None and "non-finite" in final["poisoned"].error.message
    assert final["healthy"].error is None
    assert final["healthy"].outputs[0].token_ids == expected
    assert runtime.num_pins == 0
    engine.check_integrity()
