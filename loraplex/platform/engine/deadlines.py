"""Per-request deadlines (``request_timeout_s``): which requests are past theirs, in O(log n).

The engine checks before every step. Entries hold a request's id, not the request, so a request
that finished early is not kept alive until its deadline (at 100 requests per second and a
600 s timeout that would be 60,000 finished requests); entries are never removed early (aborting
stays O(1)): the engine skips an id that is gone, or that names a later request with the same id.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from loraplex.platform.engine.sequence import Request


class Deadlines:
    """A min-heap of (deadline, tie, request id)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._tie = itertools.count()

    def add(self, req: Request) -> None:
        """Watch ``req`` (its ``deadline`` is set)."""
        if req.deadline is None:
            raise ValueError(f"request {req.request_id} has no deadline to watch")
        heapq.heappush(self._heap, (req.deadline, next(self._tie), req.request_id))

    def expired(self, now: float) -> Iterator[tuple[str, float]]:
        """(request id, deadline) of every entry due at ``now`` or earlier, each once."""
        while self._heap and self._heap[0][0] <= now:
            deadline, _, request_id = heapq.heappop(self._heap)
            yield request_id, deadline

    def __len__(self) -> int:
        return len(self._heap)
