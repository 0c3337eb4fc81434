"""Engine behaviour on a tiny model: validation, aborts, leaks, stops, seeds, logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_dirs: dict[str, Path]) -> LLM:
    return LLM(
        model=str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=64, block_size=8, max_num_seqs=16
    )


PROMPT = [5, 17, 300, 4000, 12, 9, 77, 81, 1000, 2000]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params_name_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_bad_prompts_rejected_before_allocation(llm: LLM) -> None:
    engine = llm.llm_engine
    free = engine.kv.block_manager.num_free_blocks
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate([""], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate([[]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([[5] * 5000], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[10**7]], SamplingParams(max_tokens=2), use_tqdm=False)
    # A batch with one bad prompt queues nothing.
    with pytest.raises(ValueError):
        llm.generate([PROMPT, []], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.kv.block_manager.num_free_blocks == free
    engine.check_integrity()


def test_prompt_larger_than_pool_is_never(tiny_dirs: dict[str, Path]) -> None:
    small = LLM(model=str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=4, block_size=8)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate([[5] * 40], SamplingParams(max_tokens=2), use_tqdm=False)


def test_abort_frees_all_blocks(llm: LLM) -> None:
    engine = llm.llm_engine
    for i in range(6):
        engine.add_request(f"abort-{i}", PROMPT * (i + 1), SamplingParams(max_tokens=50, n=2 if i % 2 else 1))
    for _ in range(4):
        engine.step()
    assert engine.kv.block_manager.num_free_blocks < engine.kv.block_manager.num_blocks
    for i in range(6):
        engine.abort_request(f"abort-{i}")
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.kv.block_manager.num_free_blocks == engine.kv.block_manager.num_blocks


def test_max_tokens_and_finish_reason(llm: LLM) -> None:
    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length"
    assert out.prompt_token_ids == PROMPT


def test_stop_token_ids(llm: LLM) -> None:
    ref = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    toks = ref.outputs[0].token_ids
    stop_at = toks[3]
    first = toks.index(stop_at)
    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]), use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == toks[: first + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop_at


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, top_k=50, max_tokens=10, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)
    mixed = (
        llm.generate([[9, 8, 7], PROMPT, [1000] * 30, [3, 4]], [others, p, others, others], use_tqdm=False)[1]
        .outputs[0]
        .token_ids
    )
    assert alone == again == mixed
    different = llm.generate(
        [PROMPT],
        SamplingParams(temperature=1.0, top_k=50, max_tokens=10, seed=99, ignore_eos=True),
        use_tqdm=False,
    )
    assert different[0].outputs[0].token_ids != alone


def test_logprobs_match_model_distribution(llm: LLM, tiny_dirs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True), use_tqdm=False
    )[0]
    comp = out.outputs[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["gqa_tied"], dtype=torch.float32)
    with torch.no_grad():
        logp = model(torch.tensor([PROMPT + comp.token_ids])).logits[0].log_softmax(-1)
    assert comp.logprobs is not None and len(comp.logprobs) == 4
    for j, tok in enumerate(comp.token_ids):
        row = logp[len(PROMPT) - 1 + j]
        top = row.topk(3)
        entry = comp.logprobs[j]
        assert entry[tok].rank == 1  # greedy picks the top token
        for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            assert abs(entry[t].logprob - v) < 1e-4
    assert comp.cumulative_logprob == pytest.approx(
        sum(comp.logprobs[j][t].logprob for j, t in enumerate(comp.token_ids))
    )


def test_priority_policy_runs_urgent_first(tiny_dirs: dict[str, Path]) -> None:
    llm = LLM(
        model=str(tiny_dirs["gqa_tied"]),
        dtype="float32",
        num_kv_blocks=64,
        max_num_seqs=1,
        scheduling_policy="priority",
    )
    engine = llm.llm_engine
    engine.add_request("late", PROMPT, SamplingParams(max_tokens=2), priority=5)
    engine.add_request("urgent", PROMPT, SamplingParams(max_tokens=2), priority=0)
    first = engine.step()
    assert [o.request_id for o in first] == ["urgent"]
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()


def test_chat_uses_template(tiny_dirs: dict[str, Path]) -> None:
    llm = LLM(model=str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=64)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok.encode(
        tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )
    assert out.prompt_token_ids == expected


def test_stop_string_end_to_end(llm: LLM) -> None:
    """A stop string cut out of the model's own greedy text stops it, text excluded."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, skip_special_tokens=False)
    full = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    # Pick a stop string spanning the boundary between output tokens 5 and 6.
    head = tok.decode(full.token_ids[:5], skip_special_tokens=False)
    upto7 = tok.decode(full.token_ids[:7], skip_special_tokens=False)
    stop = upto7[len(head) - 2 :]
    assert len(stop) >= 3
    params = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, skip_special_tokens=False, stop=[stop]
    )
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    assert stop not in out.text
