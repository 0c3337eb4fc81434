"""Scheduling policies: the order waiting work is admitted in, whom to preempt, per-step accounting.

The scheduler owns the queues and the KV blocks; a policy only answers its questions::

    key(seq)                     order of sequences: lower runs first (running set, preemption)
    enqueue(waiting, seq, front) where a new (or preempted, ``front``) sequence waits
    admission_order(waiting)     the order admission tries the waiting sequences in
    victim(candidates, seq)      whom to preempt so ``seq`` can run (``seq`` itself if it ranks last)
    on_scheduled(items)          what ran this step (sequence, tokens): a fair policy's accounting
    on_finished(seq)             a sequence ended

Chosen by name (``EngineConfig.scheduling_policy``): ``fcfs`` (arrival order), ``priority``
(lower ``priority`` value first, then arrival), and ``fair`` / ``fair_priority``: fair share across
tenants, FCFS or priority inside each tenant (``FairSharePolicy``, the default).

Fair share is VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024): each
tenant has a virtual token counter, the weighted service it received::

    counter[t] += (W_PROMPT * prompt tokens computed + W_OUTPUT * tokens sampled) / weight[t]

charged per step for what ran (prefix-cache hits and recomputation after a preemption are free).
Admission serves the tenant with the smallest counter first (projecting each admitted
request's prompt onto its tenant's counter, so one step's admissions interleave the tenants),
and preemption picks from the tenant with the largest. A tenant that arrives with nothing
unfinished is lifted to the smallest counter of the tenants that have work (no credit saved up
while idle). Requests without a tenant share one implicit tenant, for which ``fair`` orders
exactly like ``fcfs`` (and ``fair_priority`` like ``priority``).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import ClassVar, Literal

from loraplex.platform.engine.sequence import Sequence as Seq

PolicyName = Literal["fcfs", "priority", "fair", "fair_priority"]
POLICY_NAMES: tuple[PolicyName, ...] = ("fcfs", "priority", "fair", "fair_priority")

W_PROMPT = 1.0
"""Weight of a prompt token computed (VTC's w_p)."""
W_OUTPUT = 2.0
"""Weight of a token sampled (VTC's w_q): a decode costs a step's share per token, a prefill
token a fraction of that, so output counts double (the paper's choice)."""


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


def _tenant(seq: Seq) -> str:
    return seq.request.tenant_id or ""


class FairSharePolicy(SchedulingPolicy):
    """Fair share across tenants by virtual token counters (see the module docstring); the
    ``inner`` policy orders the sequences of one tenant (its waiting list order and its key)."""

    inner_policy: ClassVar[type[SchedulingPolicy]]

    def __init__(self) -> None:
        self.inner = self.inner_policy()
        self.counters: dict[str, float] = {}
        """Virtual token counter per tenant (``""``: requests without a tenant); kept while idle."""
        self.weights: dict[str, float] = {}
        """The weight each tenant's newest request carried."""
        self._live: dict[str, set[int]] = {}  # tenant -> its unfinished sequences (active tenants)
        self._floor = 0.0  # smallest counter among active tenants, as of the last change

    def key(self, seq: Seq) -> tuple[float, ...]:
        return self.inner.key(seq)

    def snapshot(self) -> Mapping[str, float]:
        """The counters, copied (for ``EngineStats``)."""
        return MappingProxyType(dict(self.counters))

    def enqueue(self, waiting: list[Seq], seq: Seq, *, front: bool = False) -> None:
        tenant = _tenant(seq)
        self.weights[tenant] = max(float(seq.request.tenant_weight), 1e-6)
        live = self._live.get(tenant)
        if not live:
            # Back from idle (or new): no credit for the time it sent nothing.
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), self._active_floor())
            live = self._live[tenant] = set()
        live.add(seq.seq_id)
        self.inner.enqueue(waiting, seq, front=front)

    def admission_order(self, waiting: Sequence[Seq]) -> list[Seq]:
        queues: dict[str, list[Seq]] = {}
        for seq in waiting:  # the inner policy's order within each tenant
            queues.setdefault(_tenant(seq), []).append(seq)
        if len(queues) <= 1:
            return list(waiting)
        # Merge the tenants by projected counter: each admission adds its prompt's cost, so one
        # step's admissions interleave the tenants instead of emptying the poorest one's queue.
        heap = [(self.counters.get(t, 0.0), self.inner.key(q[0]), t, 0) for t, q in queues.items()]
        heapq.heapify(heap)
        order: list[Seq] = []
        while heap:
            counter, _, tenant, i = heapq.heappop(heap)
            queue = queues[tenant]
            seq = queue[i]
            order.append(seq)
            if i + 1 < len(queue):
                cost = W_PROMPT * seq.num_uncomputed_tokens / self.weights.get(tenant, 1.0)
                heapq.heappush(heap, (counter + cost, self.inner.key(queue[i + 1]), tenant, i + 1))
        return order

    def victim(self, candidates: Sequence[Seq], seq: Seq) -> Seq:
        """The last-ranked sequence of the most-served tenant (``seq`` itself if that is it)."""
        if not candidates:
            return seq

        def rank(s: Seq) -> tuple[float, tuple[float, ...]]:
            return (self.counters.get(_tenant(s), 0.0), self.inner.key(s))

        victim = max(candidates, key=rank)
        return seq if rank(victim) < rank(seq) else victim

    def on_scheduled(self, items: Iterable[tuple[Seq, int]]) -> None:
        changed = False
        for seq, num_new in items:
            tenant = _tenant(seq)
            start = seq.num_computed_tokens
            # A preempted sequence recomputes its prompt at the server's choice: charged once.
            first_pass = seq.num_preemptions == 0
            prompt = max(0, min(start + num_new, seq.num_prompt_tokens) - start) if first_pass else 0
            sampled = 1 if start + num_new == seq.num_tokens else 0
            cost = W_PROMPT * prompt + W_OUTPUT * sampled
            self._live.setdefault(tenant, set()).add(seq.seq_id)  # forked siblings start here
            if cost:
                self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weights.get(tenant, 1.0)
                changed = True
        if changed:
            self._floor = self._active_floor()

    def on_finished(self, seq: Seq) -> None:
        tenant = _tenant(seq)
        live = self._live.get(tenant)
        if live is not None:
            live.discard(seq.seq_id)
            if not live:
                del self._live[tenant]

    def forget(self, tenant: str) -> None:
        """Drop a tenant's counter and weight (a deleted tenant), unless it has work."""
        if tenant not in self._live:
            self.counters.pop(tenant, None)
            self.weights.pop(tenant, None)

    def _active_floor(self) -> float:
        """The smallest counter among tenants with unfinished work; the last one seen if none."""
        active = [self.counters.get(t, 0.0) for t in self._live]
        if active:
            self._floor = min(active)
        return self._floor


class FairPolicy(FairSharePolicy):
    """Fair share across tenants, FCFS inside each."""

    name: ClassVar[PolicyName] = "fair"
    inner_policy: ClassVar[type[SchedulingPolicy]] = FCFSPolicy


class FairPriorityPolicy(FairSharePolicy):
    """Fair share across tenants, by priority inside each."""

    name: ClassVar[PolicyName] = "fair_priority"
    inner_policy: ClassVar[type[SchedulingPolicy]] = PriorityPolicy


_POLICIES: dict[str, type[SchedulingPolicy]] = {
    p.name: p for p in (FCFSPolicy, PriorityPolicy, FairPolicy, FairPriorityPolicy)
}


def make_policy(name: str) -> SchedulingPolicy:
    """The policy called ``name``; ValueError naming the known ones otherwise."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(f"scheduling_policy must be one of {list(POLICY_NAMES)}, got {name!r}")
    return cls()
