"""Swap preemption with parallel sampling (``n`` > 1).

A request's ``n`` samples share their prompt blocks copy-on-write, then each grows a tail
of its own. Next to it, a greedy request of another length puts the samples' lengths off
the block boundaries, so when the pool runs out the victims have partial tails to swap
out (or recompute). Every sample must end with the tokens it gets without preemption
(seeded sampling: the same per-request stream however the steps are batched), and the
token count the engine ran through the model says whether anything was recomputed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex import LLM, SamplingParams

BLOCK = 8
PROMPTS = [[(11 * i) % 900 + 5 for i in range(36)], [(13 * i) % 900 + 5 for i in range(29)]]
MAX_TOKENS = 40
PARAMS = [
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(n=3, temperature=0.9, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True),
]


def _run(tiny_dirs: dict[str, Path], num_kv_blocks: int, **kw: object) -> tuple[list[list[list[int]]], LLM]:
    llm = LLM(
        model=str(tiny_dirs["gqa_tied"]),
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=num_kv_blocks,
        **kw,  # type: ignore[arg-type]
    )
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert all(o.error is None for o in outs)
    return [sorted(list(c.token_ids) for c in o.outputs) for o in outs], llm


@pytest.fixture(scope="module")
def unpreempted(tiny_dirs: dict[str, Path]) -> tuple[list[list[list[int]]], int]:
    samples, llm = _run(tiny_dirs, 96, enable_prefix_caching=False)
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions == 0
    assert len({tuple(s) for s in samples[1]}) == 3, "the samples must differ"
    return samples, engine.num_batched_tokens


@pytest.mark.slow
def test_swapped_samples_match_and_recompute_nothing(
    tiny_dirs: dict[str, Path], unpreempted: tuple[list[list[list[int]]], int]
) -> None:
    expected, tokens_once = unpreempted
    got, llm = _run(tiny_dirs, 18, host_kv_cache_bytes=4 << 20, preemption_mode="swap")
    engine, sched = llm.llm_engine, llm.llm_engine.scheduler
    assert got == expected
    assert sched.num_preemptions > 0 and sched.num_swapped_out > 0
    assert sched.num_swapped_in == sched.num_swapped_out and sched.num_swaps_lost == 0
    assert engine.num_batched_tokens == tokens_once
    engine.check_integrity()


def test_recomputed_samples_match(
    tiny_dirs: dict[str, Path], unpreempted: tuple[list[list[list[int]]], int]
) -> None:
    expected, tokens_once = unpreempted
    got, llm = _run(tiny_dirs, 18, host_kv_cache_bytes=4 << 20, preemption_mode="recompute")
    engine = llm.llm_engine
    assert got == expected
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_swapped_out == 0
    assert engine.num_batched_tokens > tokens_once  # the partial tails were computed again
    engine.check_integrity()
