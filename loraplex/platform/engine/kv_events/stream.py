"""``KVEventStream``: the engine's KV events, collected during a step and published after it.

    stream = KVEventStream.start(config.kv_events, engine.kv, block_size)   # None when off
    ... a step: the cache's tiers emit into stream.log ...
    stream.flush()          # the step's events, one batch, handed to the publisher thread
    stream.counters         # published / dropped, for EngineStats
    stream.close()          # at shutdown

``flush`` costs the engine's thread a list swap and a ``put_nowait``; when nothing changed in
the cache no batch is made. Batches are numbered here, so one the publisher had no room for
is a gap in the sequence numbers.
"""

from __future__ import annotations

import itertools
import time

from loraplex.platform.engine.kv_events.config import KVEventsConfig
from loraplex.platform.engine.kv_events.publisher import PublisherCounters, ZmqEventPublisher
from loraplex.platform.engine.kv_events.wire import EventBatch
from loraplex.storage.kv.kv_events import KVEventLog
from loraplex.storage.kv.tiers.tiered_kv import TieredKV


class KVEventStream:
    """One engine's event log and its publisher."""

    def __init__(self, log: KVEventLog, publisher: ZmqEventPublisher) -> None:
        self.log = log
        self.publisher = publisher
        self._seq = itertools.count()

    @classmethod
    def start(cls, config: KVEventsConfig | None, kv: TieredKV, block_size: int) -> KVEventStream | None:
        """The stream ``config`` asks for, its cache wired to it; None when events are off."""
        if config is None or not config.publishes:
            return None
        publisher = ZmqEventPublisher(config, block_size)
        log = KVEventLog(enabled=True)
        kv.attach_events(log)
        return cls(log, publisher)

    def flush(self) -> None:
        """Publish what the cache reported since the last flush (nothing if it reported nothing)."""
        events = self.log.take()
        if events:
            self.publisher.publish(EventBatch(next(self._seq), time.time(), events))

    @property
    def counters(self) -> PublisherCounters:
        return self.publisher.counters

    def close(self) -> None:
        """Stop reporting, publish the last batch, stop the publisher."""
        self.log.enabled = False
        self.flush()
        self.publisher.close()
