"""``LoadTimes``: how long making an adapter resident took, as a histogram (bucket counts, sum).

Counted by the manager around each device load (the synchronous store read of a host-cache
miss included); read as a frozen ``LoadTimesSnapshot`` in ``AdapterStats``, where the server
turns it into ``vllm:lora_adapter_load_seconds``. Buckets span a GPU (sub-millisecond page
writes) and a loaded CPU reading a large adapter from disk (seconds).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

LOAD_BUCKETS_S: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Upper bounds in seconds (Prometheus' ``le``); one more bucket, +Inf, holds the rest."""


@dataclass(frozen=True)
class LoadTimesSnapshot:
    """Load durations so far: per-bucket counts (not cumulative; the last one is +Inf), their sum."""

    bucket_counts: tuple[int, ...]
    sum_s: float

    @property
    def count(self) -> int:
        return sum(self.bucket_counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count of loads at most le)`` per bucket, Prometheus' way, +Inf last."""
        out, total = [], 0
        for bound, count in zip((*LOAD_BUCKETS_S, float("inf")), self.bucket_counts, strict=True):
            total += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return out


EMPTY_LOAD_TIMES = LoadTimesSnapshot((0,) * (len(LOAD_BUCKETS_S) + 1), 0.0)


class LoadTimes:
    """The counts behind a ``LoadTimesSnapshot`` (not thread-safe: the manager's lock covers it)."""

    def __init__(self) -> None:
        self._counts = [0] * (len(LOAD_BUCKETS_S) + 1)
        self._sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(LOAD_BUCKETS_S, seconds)] += 1
        self._sum_s += seconds

    def snapshot(self) -> LoadTimesSnapshot:
        return LoadTimesSnapshot(tuple(self._counts), self._sum_s)
