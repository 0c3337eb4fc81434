"""An error while the scheduler plans one request fails that request alone.

Planning does tier I/O (a prefix continued from host RAM or disk is copied into device blocks
while the step is planned), so it can raise. Here the device side of a tier read raises once
(``write_blocks``, a bug rather than an I/O fault, which would be a counted miss): the request
whose promotion it was ends with an error naming the cause, the requests around it finish with
the tokens of an engine without any cache, the engine's integrity holds after every step, and
the prefix it was promoting is still in its tier and served on the next request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from support.engines import tiny_engine

from loraplex import SamplingParams
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.outputs import RequestOutput

BLOCK = 8
PROMPT = [(11 * i) % 900 + 5 for i in range(81)]  # 10 full blocks + 1 token
OTHERS = [[(17 * i + 3 * j) % 900 + 5 for i in range(30 + 7 * j)] for j in range(3)]
FILLERS = [[(13 * i + 7 * j) % 900 + 5 for i in range(60)] for j in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
TIERS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "host": lambda _: {"host_kv_cache_bytes": 1 << 20},
    "disk": lambda root: {"disk_kv_path": str(root / "kv"), "disk_kv_cache_bytes": 4 << 20},
}


# Twenty blocks are two prompts' worth: later traffic evicts earlier blocks.
_engine = partial(tiny_engine, block_size=BLOCK, num_kv_blocks=20, max_num_seqs=4)


def _run_all(engine: LLMEngine, prompts: dict[str, Sequence[int]]) -> dict[str, RequestOutput]:
    for rid, prompt in prompts.items():
        engine.add_request(rid, list(prompt), GREEDY)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.check_integrity()
    return finals


@pytest.fixture(scope="module")
def reference(tiny_dirs: dict[str, Path]) -> dict[str, list[int]]:
    engine = _engine(tiny_dirs, enable_prefix_caching=False)
    prompts = {"prompt": PROMPT, **{f"other-{j}": p for j, p in enumerate(OTHERS)}}
    return {rid: out.outputs[0].token_ids for rid, out in _run_all(engine, prompts).items()}


@pytest.mark.slow
@pytest.mark.parametrize("tier", sorted(TIERS))
def test_a_fault_in_a_tier_read_fails_only_its_request(
    tiny_dirs: dict[str, Path], tmp_path: Path, reference: dict[str, list[int]], tier: str
) -> None:
    engine = _engine(tiny_dirs, **TIERS[tier](tmp_path))
    _run_all(engine, {"warm": PROMPT})
    _run_all(engine, {f"filler-{j}": f for j, f in enumerate(FILLERS)})  # PROMPT's blocks go down
    assert engine.kv.tiers is not None
    device = engine.kv.tiers.device
    real_write = device.write_blocks
    faults: list[int] = []

    def faulty_write(block_ids: Sequence[int], blocks: Sequence[torch.Tensor]) -> None:
        if not faults:
            faults.append(len(block_ids))
            raise RuntimeError("injected fault in a tier read")
        real_write(block_ids, blocks)

    device.write_blocks = faulty_write  # type: ignore[method-assign]
    others = {f"other-{j}": p for j, p in enumerate(OTHERS)}
    finals = _run_all(engine, {"victim": PROMPT, **others})

    assert faults, "the promotion never copied a block: the test did not inject anything"
    victim = finals["victim"]
    assert victim.error is not None and "injected fault in a tier read" in victim.error.message, victim
    assert "while scheduling this request" in victim.error.message
    assert victim.outputs[0].finish_reason == "abort"
    for rid in others:
        assert finals[rid].error is None, finals[rid]
        assert finals[rid].outputs[0].token_ids == reference[rid], rid
    # The fault cost nothing else: the prefix is still below and the next request hits it.
    again = _run_all(engine, {"again": PROMPT})["again"]
    assert again.error is None and again.outputs[0].token_ids == reference["prompt"]
    assert again.num_cached_tokens == 10 * BLOCK
    assert engine.scheduler.num_planning_failures == 1


def test_a_planning_error_outside_any_one_request_leaves_the_engine_serving(
    tiny_dirs: dict[str, Path], reference: dict[str, list[int]]
) -> None:
    """schedule() raising as a whole (its state intact) fails the unfinished requests; the
    engine checks its integrity and serves the next request normally."""
    engine = _engine(tiny_dirs)
    real_schedule = engine.scheduler.schedule
    raised: list[bool] = []

    def schedule_once_broken() -> Any:
        if not raised:
            raised.append(True)
            raise RuntimeError("injected planning bug")
        return real_schedule()

    engine.scheduler.schedule = schedule_once_broken  # type: ignore[method-assign]
    finals = _run_all(engine, {f"other-{j}": p for j, p in enumerate(OTHERS)})
    assert raised and len(finals) == len(OTHERS)
    for out in finals.values():
        assert out.error is not None and "injected planning bug" in out.error.message
    after = _run_all(engine, {"prompt": PROMPT})["prompt"]
    assert after.error is None and after.outputs[0].token_ids == reference["prompt"]
