"""``KVEventsCollector``: what the KV event publisher did, in ``/metrics`` (``kv_events_config``).

A subscriber that is slow or gone never slows a step: the publisher drops instead (its queue
full), so drops are the one sign of trouble, and an operator alerts on them here:

| family (counters) | labels | what |
|---|---|---|
| ``loraplex_kv_events_batches_total`` | ``outcome`` | batches (one per step that changed the cache) |
| ``loraplex_kv_events_total`` | ``outcome`` | events in those batches |
| ``loraplex_kv_events_replays_total`` | | replay requests answered |
| ``loraplex_kv_events_errors_total`` | | batches that could not be encoded or sent |

``outcome`` is published or dropped. Nothing is exported while events are off. Read from the
engine's snapshot at each scrape.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplex.platform.engine.async_engine import AsyncEngine


class KVEventsCollector(Collector):
    """The publisher's counters from the engine's last snapshot."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        counters = self.engine.stats.kv_events
        if counters is None:
            return
        batches = CounterMetricFamily(
            "loraplex_kv_events_batches", "KV event batches, by what became of them.", labels=["outcome"]
        )
        batches.add_metric(["published"], counters.num_batches_published)
        batches.add_metric(["dropped"], counters.num_batches_dropped)
        yield batches
        events = CounterMetricFamily(
            "loraplex_kv_events", "KV events, by what became of them.", labels=["outcome"]
        )
        events.add_metric(["published"], counters.num_events_published)
        events.add_metric(["dropped"], counters.num_events_dropped)
        yield events
        yield CounterMetricFamily(
            "loraplex_kv_events_replays", "KV event replay requests answered.", value=counters.num_replays
        )
        yield CounterMetricFamily(
            "loraplex_kv_events_errors", "KV event batches that could not be sent.", value=counters.num_errors
        )
