"""Scheduling policies by name: their order, their victims, and an unknown name refused."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.policy import POLICY_NAMES, make_policy


def _seq(name: str, arrival: float, priority: int = 0, index: int = 0) -> Any:
    # A policy reads only these attributes of a sequence.
    return SimpleNamespace(
        name=name, index=index, request=SimpleNamespace(arrival_time=arrival, priority=priority)
    )


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
    assert POLICY_NAMES == ("fcfs", "priority")
    with pytest.raises(ValueError, match="fcfs"):
        make_policy("fair")
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineConfig(scheduling_policy="lottery")  # type: ignore[arg-type]
