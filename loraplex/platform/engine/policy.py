"""Scheduling policies: the order waiting work is admitted in, whom to preempt, per-step accounting.

The scheduler owns the queues and the KV blocks; a policy only answers its questions::

    key(seq)                     order of sequences: lower runs first (running set, preemption)
    enqueue(waiting, seq, front) where a new (or preempted, ``front``) sequence waits
    admission_order(waiting)     the order admission tries the waiting sequences in
    victim(candidates, seq)      whom to preempt so ``seq`` can run (``seq`` itself if it ranks last)
    on_scheduled(items)          what ran this step (sequence, tokens): a fair policy's accounting
    on_finished(seq)             a sequence ended

Chosen by name (``EngineConfig.scheduling_policy``): ``fcfs`` (arrival order) and ``priority``
(lower ``priority`` value first, then arrival). A fair policy across tenants plugs in here
(it orders admission by each tenant's received service and accounts it per step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import ClassVar, Literal

from loraplex.platform.engine.sequence import Sequence as Seq

PolicyName = Literal["fcfs", "priority"]
POLICY_NAMES: tuple[PolicyName, ...] = ("fcfs", "priority")


class SchedulingPolicy(ABC):
    """What the scheduler asks about order; the defaults serve any policy whose order is ``key``."""

    name: ClassVar[PolicyName]

    @abstractmethod
    def key(self, seq: Seq) -> tuple[float, ...]:
        """The sequence's rank: lower runs first and is preempted last."""

    def enqueue(self, waiting: list[Seq], seq: Seq, *, front: bool = False) -> None:
        """Put ``seq`` in the waiting queue (``front``: a preempted sequence, resumed first)."""
        if front:
            waiting.insert(0, seq)
        else:
            waiting.append(seq)

    def admission_order(self, waiting: Sequence[Seq]) -> list[Seq]:
        """The waiting sequences in the order admission tries them (a copy: admission edits the queue)."""
        return list(waiting)

    def victim(self, candidates: Sequence[Seq], seq: Seq) -> Seq:
        """Whom to preempt so ``seq`` can run: the last-ranked candidate, or ``seq`` if it ranks
        below every candidate (then ``seq`` itself waits)."""
        if not candidates:
            return seq
        victim = max(candidates, key=self.key)
        return seq if self.key(victim) < self.key(seq) else victim

    def on_scheduled(self, items: Iterable[tuple[Seq, int]]) -> None:
        """The sequences a step runs and how many tokens each (accounting; nothing by default)."""
        return None

    def on_finished(self, seq: Seq) -> None:
        """``seq`` finished, was aborted or failed (nothing by default)."""
        return None


class FCFSPolicy(SchedulingPolicy):
    """First come, first served: arrival order; a preempted sequence resumes first."""

    name: ClassVar[PolicyName] = "fcfs"

    def key(self, seq: Seq) -> tuple[float, ...]:
        return (seq.request.arrival_time, seq.index)


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` first (vLLM's convention), then arrival; the queue stays sorted."""

    name: ClassVar[PolicyName] = "priority"

    def key(self, seq: Seq) -> tuple[float, ...]:
        return (seq.request.priority, seq.request.arrival_time, seq.index)

    def enqueue(self, waiting: list[Seq], seq: Seq, *, front: bool = False) -> None:
        super().enqueue(waiting, seq, front=front)
        waiting.sort(key=self.key)


_POLICIES: dict[str, type[SchedulingPolicy]] = {p.name: p for p in (FCFSPolicy, PriorityPolicy)}


def make_policy(name: str) -> SchedulingPolicy:
    """The policy called ``name``; ValueError naming the known ones otherwise."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(f"scheduling_policy must be one of {sorted(_POLICIES)}, got {name!r}")
    return cls()
