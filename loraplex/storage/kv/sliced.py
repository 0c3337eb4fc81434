"""Long maintenance on the KV tiers (a tenant's purge, a cache reset) cut into bounded slices.

A purge of a disk tier of 100,000 blocks touches 100,000 slot files: run at once, it would stop
the engine for seconds. Written as a generator instead, it yields after each bounded piece of
work (one file erased, a chunk of index entries dropped), and the engine runs it between steps
for a time budget per step::

    job = SlicedJob("purge", tiered_kv.purge_steps(owner))
    while not job.run(budget_s=0.02):   # between steps
        ...                              # a step runs
    job.result

Each slice takes the tiers' locks itself, so the state between slices is consistent and other
work (steps, promotions, demotions) interleaves. ``run_to_end`` runs one at once (offline calls).
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
Item = TypeVar("Item")

Steps = Generator[bool | None, None, T]
"""A computation that yields between bounded pieces of work and returns its result; it yields
``WAIT`` when it waits for work elsewhere (I/O threads), which ends the slice at once."""

WAIT = True
"""What a ``Steps`` yields to say: nothing to do now, end this slice (rather than spin)."""
_WAIT_POLL_S = 0.001


def run_to_end(steps: Steps[T]) -> T:
    """Run ``steps`` without stopping; its result."""
    while True:
        try:
            if next(steps) is WAIT:
                time.sleep(_WAIT_POLL_S)
        except StopIteration as stop:
            result: T = stop.value
            return result


def chunks(items: Sequence[Item], size: int) -> Generator[Sequence[Item], None, None]:
    """``items`` in consecutive pieces of at most ``size``."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


class SlicedJob(Generic[T]):
    """A ``Steps`` run a time budget at a time; ``result`` once ``run`` returned True."""

    def __init__(self, name: str, steps: Steps[T]) -> None:
        self.name = name
        self._steps = steps
        self.done = False
        self.result: T | None = None
        self.error: Exception | None = None
        """What ended it, when a piece raised (set by the queue that ran it)."""
        self.num_slices = 0
        self.max_slice_s = 0.0
        """The longest slice so far (what a step waited for this job, at most)."""
        self.total_s = 0.0

    def finish(self) -> T:
        """Run the rest at once (waiting for I/O where a piece says ``WAIT``); the result."""
        while not self.run(math.inf):
            time.sleep(_WAIT_POLL_S)
        result: T = self.result  # type: ignore[assignment]  # set when run returned True
        return result

    def run(self, budget_s: float) -> bool:
        """Run pieces until ``budget_s`` is spent (at least one piece); True when finished.

        A piece raising ends the job: the error propagates and the job counts as done."""
        if self.done:
            return True
        start = time.perf_counter()
        self.num_slices += 1
        try:
            while True:
                if next(self._steps) is WAIT or time.perf_counter() - start >= budget_s:
                    return False
        except StopIteration as stop:
            self.result = stop.value
            self.done = True
            return True
        except BaseException:
            self.done = True
            raise
        finally:
            elapsed = time.perf_counter() - start
            self.total_s += elapsed
            self.max_slice_s = max(self.max_slice_s, elapsed)
