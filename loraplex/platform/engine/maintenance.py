"""Maintenance between steps: purges and prefix-cache resets, run a time budget at a time.

A purge of a tenant's cached KV on a large disk tier touches as many files as it has blocks;
run at once it would stall every running request. The engine queues such work as
``SlicedJob``s here and the caller (the server's engine thread) runs a bounded slice of them
between two steps (``MaintenanceQueue.run``), so a step never waits longer than one slice.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator
from typing import Any

from loraplex.storage.kv.sliced import SlicedJob

logger = logging.getLogger(__name__)


class MaintenanceQueue:
    """The jobs in progress, oldest first, and how long their slices took."""

    def __init__(self) -> None:
        self._jobs: collections.deque[SlicedJob[Any]] = collections.deque()
        self.num_slices = 0
        """Slices run so far."""
        self.max_slice_s = 0.0
        """The longest slice run between two steps so far."""

    def add(self, job: SlicedJob[Any]) -> None:
        """Queue ``job`` behind the others."""
        self._jobs.append(job)

    def remove(self, job: SlicedJob[Any]) -> None:
        """Take ``job`` out of the queue (its owner runs it to the end itself)."""
        self._jobs.remove(job)

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[SlicedJob[Any]]:
        return iter(self._jobs)

    def run(self, budget_s: float) -> list[SlicedJob[Any]]:
        """Run the queued jobs for about ``budget_s`` (at least one piece of the first); the
        jobs that ended, in order: finished (``result``) or failed (``error``; logged, dropped,
        and the slice ends there: the error is its job's caller's, never the engine loop's)."""
        ended: list[SlicedJob[Any]] = []
        start = time.perf_counter()
        while self._jobs:
            job = self._jobs[0]
            try:
                done = job.run(max(0.0, budget_s - (time.perf_counter() - start)))
            except Exception as exc:
                logger.exception("maintenance job %r failed", job.name)
                job.error = exc
                ended.append(self._jobs.popleft())
                break
            finally:
                self.num_slices += 1
                self.max_slice_s = max(self.max_slice_s, job.max_slice_s)
            if not done:
                break
            ended.append(self._jobs.popleft())
        return ended
