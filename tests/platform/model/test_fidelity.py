"""Greedy outputs equal HF transformers ``generate`` token for token (float32, CPU).

Each model runs the same prompts under several engine shapes: one request alone;
32 mixed-length requests at once; a token budget so small that prefills are
chunked over many steps; a KV pool so small that requests are preempted and
recomputed; and n = 4 parallel sampling sharing a prompt.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from support.fidelity import Reference, assert_greedy_match, hf_greedy

from loraplex import LLM, SamplingParams

MAX_NEW = 12


def _prompts(num: int, seed: int, max_len: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 15, 16, 17, max_len] + [rng.randint(2, max_len) for _ in range(num - 5)]
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths[:num]]


def _hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def _references(model_dir: Path, prompts: list[list[int]], max_new: int) -> list[Reference]:
    model = _hf_model(model_dir)
    return [hf_greedy(model, p, max_new, (2,)) for p in prompts]


def _run(llm: LLM, prompts: list[list[int]], max_new: int, n: int = 1) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_new, n=n)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.kv.block_manager.num_free_blocks == llm.llm_engine.kv.block_manager.num_blocks
    return outs


def _check(outs: list[Any], refs: list[Reference], what: str) -> None:
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        for comp in out.outputs:
            assert_greedy_match(comp.token_ids, ref, what=f"{what} prompt {i} completion {comp.index}")


TINY = ["mha_untied", "gqa_tied", "gqa3_bias", "qwen2", "llama3_rope"]


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_match_hf(name: str, tiny_dirs: dict[str, Path]) -> None:
    model_dir = tiny_dirs[name]
    prompts = _prompts(32, seed=TINY.index(name))
    refs = _references(model_dir, prompts, MAX_NEW)

    # One request alone, with torch's F.linear and with the default (the C panel kernel).
    plain = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=256, linear_backend="torch")
    _check(_run(plain, prompts[4:5], MAX_NEW), refs[4:5], f"{name} single, torch linear")
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=256, max_num_seqs=32)
    _check(_run(llm, prompts[4:5], MAX_NEW), refs[4:5], f"{name} single")
    # 32 mixed-length requests at once.
    _check(_run(llm, prompts, MAX_NEW), refs, f"{name} batch32")

    # Token budget so small that 70-token prompts take many chunked steps.
    chunked = LLM(
        model=str(model_dir), dtype="float32", num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=7
    )
    _check(_run(chunked, prompts, MAX_NEW), refs, f"{name} chunked")

    # A pool of 24 blocks of 8 tokens cannot hold the batch: preemption + recompute.
    tight = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=24, block_size=8, max_num_seqs=16)
    _check(_run(tight, prompts, MAX_NEW), refs, f"{name} preempted")
    assert tight.llm_engine.scheduler.num_preemptions > 0, "the tight pool was meant to force preemption"


@pytest.mark.slow
def test_parallel_sampling_greedy_and_cow(tiny_dirs: dict[str, Path]) -> None:
    """n = 4 shares the prompt's blocks; greedy children equal the reference, and
    sampled children's logprobs equal HF's teacher-forced logprobs (KV not corrupted
    by siblings writing into shared blocks)."""
    model_dir = tiny_dirs["gqa_tied"]
    prompts = _prompts(6, seed=7)
    refs = _references(model_dir, prompts, MAX_NEW)
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128, block_size=8, max_num_seqs=24)
    _check(_run(llm, prompts, MAX_NEW, n=4), refs, "n=4 greedy")

    params = SamplingParams(temperature=1.5, max_tokens=MAX_NEW, n=4, seed=11, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.check_integrity()
    model = _hf_model(model_dir)
    distinct = 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.outputs) == 4
        distinct += len({tuple(c.token_ids) for c in out.outputs}) > 1
        for comp in out.outputs:
            full = torch.tensor([prompt + comp.token_ids])
            with torch.no_grad():
                logp = model(full).logits[0].float().log_softmax(-1)
            for j, tok in enumerate(comp.token_ids):
                expected = float(logp[len(prompt) - 1 + j, tok])
                got = comp.logprobs[j][tok].logprob
                assert abs(expected - got) < 1e-3, f"completion {comp.index} token {j}: {got} vs {expected}"
    assert distinct >= 4, "temperature 1.5 should make siblings diverge"


@pytest.mark.slow
def test_smollm2_matches_hf(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away, there lived a",
        "List three colours:",
    ]
    chats = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in ("What is 2+2?", "Name a fruit.", "Write a haiku about the sea.", "Who wrote Hamlet?")
    ]
    # Kept short: SmolLM2 on 2 CPU cores costs ~0.3 GFLOP per token.
    prompts = [tok.encode(t) for t in texts + chats] + _prompts(24, seed=5, max_len=40)
    new = 8
    refs = _references(smollm2_dir, prompts, new)
    llm = LLM(dtype="float32", num_kv_blocks=256, max_num_seqs=32)
    _check(_run(llm, prompts[:1], new), refs[:1], "smollm2 single")
    _check(_run(llm, prompts, new), refs, "smollm2 batch32")
    chunked = LLM(dtype="float32", num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=24)
    _check(_run(chunked, prompts, new), refs, "smollm2 chunked")
    tight = LLM(dtype="float32", num_kv_blocks=12, block_size=16, max_num_seqs=32)
    _check(_run(tight, prompts, new), refs, "smollm2 preempted")
    assert tight.llm_engine.scheduler.num_preemptions > 0
    _check(_run(llm, prompts[:6], new, n=4), refs[:6], "smollm2 n=4")
