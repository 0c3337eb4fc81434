"""``RecentLatencies``: time to first token of the latest requests, for the admin dashboard.

The gate adds each admitted request's time to first token when it closes (from the engine's
``RequestOutput.metrics``: arrival and first-token times on the engine's monotonic clock); the
dashboard asks for percentiles over the last ``window_s``. A bounded deque on the event loop:
no lock, no growth, and old entries fall out by age or by count.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from loraplex.platform.engine.outputs import RequestOutput


def time_to_first_token(outputs: Sequence[RequestOutput | None]) -> float | None:
    """Seconds from arrival to the first token of the fastest prompt of a request; None if no
    token came (refused, failed or aborted before one)."""
    best: float | None = None
    for out in outputs:
        if out is None:
            continue
        first, arrival = out.metrics.get("first_token_time"), out.metrics.get("arrival_time")
        if first is not None and arrival is not None:
            best = first - arrival if best is None else min(best, first - arrival)
    return best


class RecentLatencies:
    """The latest ``max_items`` latencies (seconds) with the time they were added."""

    def __init__(self, max_items: int = 4096, window_s: float = 300.0) -> None:
        self.window_s = window_s
        self._items: deque[tuple[float, float]] = deque(maxlen=max_items)

    def add(self, seconds: float) -> None:
        self._items.append((time.monotonic(), max(0.0, seconds)))

    def percentiles(self, quantiles: Sequence[float]) -> list[float] | None:
        """The quantiles (0-1, nearest rank) of the latencies of the last ``window_s``; None if none."""
        since = time.monotonic() - self.window_s
        values = sorted(v for at, v in self._items if at >= since)
        if not values:
            return None
        return [values[min(len(values) - 1, max(0, round(q * len(values)) - 1))] for q in quantiles]
