"""Scheduling policies by name: their order, their victims, fair share's accounting, and an
unknown name refused."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.policy import POLICY_NAMES, W_OUTPUT, W_PROMPT, make_policy

_ids = iter(range(1_000_000))


def _seq(
    name: str,
    arrival: float,
    priority: int = 0,
    index: int = 0,
    tenant: str | None = None,
    weight: float = 1.0,
    prompt: int = 4,
) -> Any:
    # A policy reads only these attributes of a sequence.
    request = SimpleNamespace(arrival_time=arrival, priority=priority, tenant_id=tenant, tenant_weight=weight)
    return SimpleNamespace(
        name=name,
        index=index,
        seq_id=next(_ids),
        request=request,
        num_computed_tokens=0,
        num_prompt_tokens=prompt,
        num_tokens=prompt,
        num_uncomputed_tokens=prompt,
        num_preemptions=0,
    )


def _run(policy: Any, seq: Any, num_new: int) -> None:
    """``seq`` computes ``num_new`` tokens this step (sampling when it reaches its end)."""
    policy.on_scheduled([(seq, num_new)])
    seq.num_computed_tokens += num_new
    if seq.num_computed_tokens == seq.num_tokens:
        seq.num_tokens += 1  # the token it sampled


def test_fcfs_and_priority_order_and_victims() -> None:
    a, b, c = _seq("a", 1.0, priority=5), _seq("b", 2.0, priority=0), _seq("c", 3.0, priority=1)
    fcfs, prio = make_policy("fcfs"), make_policy("priority")
    for policy, order in ((fcfs, "abc"), (prio, "bca")):
        waiting: list[Any] = []
        for seq in (a, b, c):
            policy.enqueue(waiting, seq)
        assert "".join(s.name for s in policy.admission_order(waiting)) == order, policy.name
    # FCFS preempts the newest; priority the lowest priority (highest value).
    assert fcfs.victim([a, b], c) is c  # c is the newest: it waits itself
    assert fcfs.victim([b, c], a).name == "c"
    assert prio.victim([b, c], a) is a  # a ranks below both: it waits itself
    assert prio.victim([a, b], c).name == "a"
    # A preempted sequence resumes first under FCFS.
    waiting = [b, c]
    fcfs.enqueue(waiting, a, front=True)
    assert [s.name for s in waiting] == ["a", "b", "c"]


def test_unknown_policy_names_are_refused() -> None:
    assert POLICY_NAMES == ("fcfs", "priority", "fair", "fair_priority")
    assert EngineConfig().scheduling_policy == "fair"
    with pytest.raises(ValueError, match="fcfs"):
        make_policy("lottery")
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineConfig(scheduling_policy="lottery")  # type: ignore[arg-type]


def test_fair_share_without_tenants_orders_exactly_like_fcfs() -> None:
    fair, fcfs = make_policy("fair"), make_policy("fcfs")
    a, b, c = _seq("a", 1.0), _seq("b", 2.0), _seq("c", 3.0)
    for policy in (fair, fcfs):
        waiting: list[Any] = []
        for seq in (b, c):
            policy.enqueue(waiting, seq)
        policy.enqueue(waiting, a, front=True)
        assert [s.name for s in policy.admission_order(waiting)] == ["a", "b", "c"]
        assert policy.victim([a, b], c) is c and policy.victim([b, c], a).name == "c"


def test_fair_share_serves_the_tenant_with_the_least_weighted_service_first() -> None:
    fair = make_policy("fair")
    waiting: list[Any] = []
    heavy = [_seq(f"a{i}", float(i), tenant="A") for i in range(4)]
    for seq in heavy:
        fair.enqueue(waiting, seq)
    _run(fair, heavy[0], 4)  # A's first request ran its prompt (4) and sampled one token (2)
    assert fair.counters["A"] == 4 * W_PROMPT + W_OUTPUT
    waiting.remove(heavy[0])
    light = _seq("b0", 10.0, tenant="B")
    fair.enqueue(waiting, light)
    # B arrives idle: lifted to A's counter (no credit for having sent nothing), so it ties, and
    # the tie goes by arrival; once A is charged again, B goes first and then they interleave.
    assert fair.counters["B"] == fair.counters["A"]
    _run(fair, heavy[0], 1)
    more_b = _seq("b1", 11.0, tenant="B")
    fair.enqueue(waiting, more_b)
    assert [s.name for s in fair.admission_order(waiting)] == ["b0", "a1", "b1", "a2", "a3"]
    # Preemption takes from the most-served tenant (A), its newest sequence.
    assert fair.victim([heavy[1], heavy[2], light], more_b).name == "a2"
    # An idle tenant keeps its counter but is lifted when it returns.
    for seq in (light, more_b):
        fair.on_finished(seq)
    for _ in range(5):
        _run(fair, heavy[0], 1)
    back = _seq("b2", 20.0, tenant="B")
    fair.enqueue(waiting, back)
    assert fair.counters["B"] == fair.counters["A"]


def test_weights_scale_the_service_a_tenant_is_charged() -> None:
    fair = make_policy("fair_priority")
    a, b = _seq("a", 1.0, tenant="A", weight=1.0), _seq("b", 2.0, tenant="B", weight=3.0)
    waiting: list[Any] = []
    fair.enqueue(waiting, a)
    fair.enqueue(waiting, b)
    for _ in range(6):
        _run(fair, a, 1 if a.num_computed_tokens else 4)
        _run(fair, b, 1 if b.num_computed_tokens else 4)
    assert fair.counters["A"] == pytest.approx(3 * fair.counters["B"])
    # Preempted, ``a`` recomputes its prompt and its tokens so far: only the new sample is charged.
    before = fair.counters["A"]
    a.num_computed_tokens, a.num_preemptions = 0, 1
    _run(fair, a, a.num_tokens)
    assert fair.counters["A"] == before + W_OUTPUT
    # Inside a tenant, fair_priority orders by priority.
    urgent, late = _seq("u", 5.0, priority=-1, tenant="B", weight=3.0), _seq("l", 4.0, tenant="B", weight=3.0)
    queue: list[Any] = []
    fair.enqueue(queue, late)
    fair.enqueue(queue, urgent)
    assert [s.name for s in fair.admission_order(queue)] == ["u", "l"]
