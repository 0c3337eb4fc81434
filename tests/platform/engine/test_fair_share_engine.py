"""Fair share, deadlines and the queue bound in the engine itself (a tiny model; the HTTP-level
acceptance tests on the real model are ``tests/e2e/test_fair_share.py``).

- weights 1 and 3, both tenants backlogged: output tokens 1 : 3 (the engine's own counters);
- no tenant at all: ``fair`` produces exactly ``fcfs``'s outputs and order;
- a request past its deadline ends with ``ErrorKind.DEADLINE`` and frees its blocks, waiting or
  running; bad weights and deadlines are refused at submission;
- ``max_queued`` refuses at once (``EngineOverloadedError``), queues nothing, counts it.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from pathlib import Path

import pytest
from support.engines import tiny_engine

from loraplex import SamplingParams
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.errors import EngineOverloadedError, ErrorKind, InvalidParameterError
from loraplex.platform.engine.outputs import RequestOutput

_engine = partial(tiny_engine, num_kv_blocks=256, max_num_seqs=4)  # the fair policy: the default


def _prompt(i: int) -> list[int]:
    return [100 + (i * 37 + j * 11) % 4000 for j in range(12)]


def test_weights_share_the_output_tokens_of_backlogged_tenants(tiny_dirs: dict[str, Path]) -> None:
    engine = _engine(tiny_dirs)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    added = 0
    for tenant, weight, count in (("light", 1.0, 8), ("heavy", 3.0, 24)):
        for _ in range(count):
            engine.add_request(
                f"{tenant}-{added}", _prompt(added), params, tenant_id=tenant, tenant_weight=weight
            )
            added += 1

    def backlogged() -> bool:
        tenants = {seq.request.tenant_id for seq in engine.scheduler.waiting}
        return tenants == {"light", "heavy"}

    while backlogged():  # the window: while both tenants have more work than can run
        engine.step()
    generated = {t: engine.stats.tenants[t].generated_tokens for t in ("light", "heavy")}
    assert engine.num_steps >= 40, engine.num_steps
    ratio = generated["heavy"] / generated["light"]
    assert 2.7 <= ratio <= 3.3, generated
    counters = engine.stats.virtual_counters
    # Weighted service converges: each counter is service / weight.
    assert counters["heavy"] == pytest.approx(counters["light"], rel=0.15), counters
    assert engine.stats.tenant_weights == {"light": 1.0, "heavy": 3.0}


def test_without_tenants_fair_is_fcfs(tiny_dirs: dict[str, Path]) -> None:
    finals: dict[str, list[tuple[str, list[int]]]] = {}
    for policy in ("fair", "fcfs"):
        engine = _engine(tiny_dirs, scheduling_policy=policy, max_num_seqs=2)
        for i in range(6):
            engine.add_request(
                str(i), _prompt(i), SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True)
            )
        order: list[tuple[str, list[int]]] = []
        while engine.has_unfinished_requests():
            order += [(o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished]
        finals[policy] = order
        assert engine.stats.virtual_counters == (
            {"": engine.stats.virtual_counters[""]} if policy == "fair" else {}
        )
    assert finals["fair"] == finals["fcfs"]


def _run_until_done(engine: LLMEngine, rid: str, timeout_s: float = 30.0) -> RequestOutput:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError(f"{rid} did not finish")


def test_a_request_past_its_deadline_ends_typed_and_frees_its_blocks(tiny_dirs: dict[str, Path]) -> None:
    engine = _engine(tiny_dirs, max_num_seqs=1)
    long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
    engine.add_request("running", _prompt(0), long, timeout_s=0.3)
    engine.add_request("waiting", _prompt(1), long, timeout_s=0.2)  # never admitted: one seat
    engine.add_request("patient", _prompt(2), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    for rid, state in (("running", "running"), ("waiting", "waiting")):
        error = outs[rid].error
        assert error is not None and error.kind is ErrorKind.DEADLINE, outs[rid]
        assert f"it was {state} when it ended" in error.message
    assert outs["running"].outputs[0].token_ids and not outs["waiting"].outputs[0].token_ids
    assert outs["patient"].error is None and len(outs["patient"].outputs[0].token_ids) == 3
    assert engine.stats.rejections == {"deadline": 2}
    assert engine.stats.tenants[""].num_failed == 2
    assert not list(engine.kv.block_manager.seq_ids())
    engine.check_integrity()


def test_bad_weights_and_deadlines_are_refused(tiny_dirs: dict[str, Path]) -> None:
    engine = _engine(tiny_dirs)
    params = SamplingParams(max_tokens=2)
    for weight in (0, -1.0, float("nan"), 1001, True):
        with pytest.raises(InvalidParameterError, match="tenant_weight") as info:
            engine.add_request("w", _prompt(0), params, tenant_weight=weight)  # type: ignore[arg-type]
        assert info.value.param == "tenant_weight"
    for timeout in (0, -2.0, float("inf")):
        with pytest.raises(InvalidParameterError, match="timeout_s"):
            engine.add_request("t", _prompt(0), params, timeout_s=timeout)
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_past_max_queued_a_request_is_refused_at_once(tiny_dirs: dict[str, Path]) -> None:
    aeng = AsyncEngine(_engine(tiny_dirs, max_num_seqs=1))
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run() -> tuple[int, int, float]:
        streams = []
        refused = 0
        slowest = 0.0
        for i in range(8):
            started = time.monotonic()
            try:
                streams.append(await aeng.add_request(str(i), _prompt(i), params, max_queued=3))
            except EngineOverloadedError as exc:
                refused += 1
                assert exc.limit == 3 and "max_queued_requests" in str(exc)
            slowest = max(slowest, time.monotonic() - started)
        for stream in streams:
            async for _ in stream:
                pass
        return len(streams), refused, slowest

    try:
        admitted, refused, slowest = asyncio.run(run())
        # One running and three queued at most: the rest were refused, none queued.
        assert 4 <= admitted <= 5 and admitted + refused == 8, (admitted, refused)
        assert slowest < 1.0
        assert aeng.stats.rejections["overload"] == refused
        assert aeng.stats.tenants[""].num_requests == admitted
    finally:
        aeng.shutdown()


def test_a_finished_requests_deadline_never_ends_a_later_request_with_its_id(
    tiny_dirs: dict[str, Path],
) -> None:
    engine = _engine(tiny_dirs)
    quick = SamplingParams(temperature=0, max_tokens=1)
    engine.add_request("r", _prompt(0), quick, timeout_s=0.2)
    first = _run_until_done(engine, "r")
    assert first.error is None
    engine.add_request(
        "r", _prompt(1), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), timeout_s=60
    )
    time.sleep(0.25)  # the first one's deadline passes while the second runs
    second = _run_until_done(engine, "r")
    assert second.error is None and len(second.outputs[0].token_ids) == 40
    assert engine.stats.rejections.get("deadline", 0) == 0
