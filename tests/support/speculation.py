"""What the speculative-decoding tests share: copy-heavy prompts, a run whose pool is checked after
every step, and a random workload of speculation, parallel sampling, aborts and preemption."""

from __future__ import annotations

import random

from loraplex import LLM, SamplingParams


def copy_prompt(seed: int, length: int = 24, copy: bool = True) -> list[int]:
    """A random passage, then (``copy``) the passage again cut short: a model continues by
    copying, and prompt lookup has something to look up."""
    rng = random.Random(seed)
    text = [rng.randrange(100, 2000) for _ in range(length)]
    return [1, *text, *text[: length // 2]] if copy else [1, *text]


def run_checked(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Each request's tokens, the pool's invariants checked after every step, no request failed."""
    engine = llm.llm_engine
    ids = []
    for prompt, sp in zip(prompts, params, strict=True):
        rid = engine.next_request_id()
        engine.add_request(rid, prompt, sp)
        ids.append(rid)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.outputs[0].token_ids
        engine.check_integrity()
    return [done[r] for r in ids]


def random_workload(llm: LLM, seed: int, steps: int, max_new: int) -> None:
    """Requests (n 1 or 2, greedy or sampled, copy prompts) arriving and aborted at random for up
    to ``steps`` steps, then run to the end: the pool is checked after every step, and at the end
    every block is back."""
    engine = llm.llm_engine
    rng = random.Random(seed)
    live: set[str] = set()
    for step in range(steps):
        if rng.random() < 0.3 and len(live) < 10:
            rid = engine.next_request_id()
            n = rng.choice([1, 1, 2])
            temp = rng.choice([0.0, 0.0, 1.0])
            sp = SamplingParams(max_tokens=rng.randrange(4, max_new), temperature=temp, n=n, ignore_eos=True)
            engine.add_request(rid, copy_prompt(rng.randrange(4), rng.choice([8, 16, 24])), sp)
            live.add(rid)
        if live and rng.random() < 0.08:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
        engine.check_integrity()
        if step > steps - 20 and not live:
            break
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert engine.kv.block_manager.num_free_blocks == engine.kv.block_manager.num_blocks
