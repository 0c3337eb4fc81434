"""Per-request deadlines (``request_timeout_s``): which requests are past theirs, in O(log n).

The engine checks before every step; a request that finished earlier is skipped when its
deadline comes up (entries are never removed early: aborting stays O(1)).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from loraplex.platform.engine.sequence import Request


class Deadlines:
    """A min-heap of (deadline, tie, request)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._tie = itertools.count()

    def add(self, req: Request) -> None:
        """Watch ``req`` (its ``deadline`` is set)."""
        assert req.deadline is not None, "a request without a deadline has nothing to watch"
        heapq.heappush(self._heap, (req.deadline, next(self._tie), req))

    def expired(self, now: float) -> Iterator[Request]:
        """Every watched request whose deadline is ``now`` or earlier (each once)."""
        while self._heap and self._heap[0][0] <= now:
            yield heapq.heappop(self._heap)[2]

    def __len__(self) -> int:
        return len(self._heap)
