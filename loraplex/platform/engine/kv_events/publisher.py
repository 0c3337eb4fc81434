"""``ZmqEventPublisher``: KV event batches out over ZeroMQ, on a thread of their own, as vLLM does.

    PUB socket      every batch as three frames: (topic, seq as 8 bytes big-endian, msgpack payload)
    ROUTER socket   (``replay_endpoint``) a subscriber sends a start sequence number (8 bytes
                    big-endian); it gets every batch still buffered from there as
                    (topic, seq, payload), then (b"", -1 as 8 bytes, b"") to end the replay

The engine's thread only ever calls ``publish``: a ``put_nowait`` into a bounded queue. It
never waits: a full queue (the thread fell behind) drops the batch, counted, and its sequence
number stays a gap that a subscriber sees. The PUB socket never blocks either: with no
subscriber ZeroMQ discards at once, and a slow subscriber past the high-water mark loses
messages (a subscriber that notices a gap asks for a replay). Encoding (``wire``) runs on the
publisher thread. Sockets are made, used and closed on that thread only (ZeroMQ sockets are
not thread-safe); a bind that fails is raised by the constructor.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass

import zmq

from loraplex.platform.engine.kv_events.config import KVEventsConfig
from loraplex.platform.engine.kv_events.wire import EventBatch, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The last frame's sequence number of a replay: nothing more follows."""
_POLL_S = 0.05
_STOP_S = 2.0


@dataclass(frozen=True)
class PublisherCounters:
    """What a publisher did since it started (cumulative)."""

    num_batches_published: int = 0
    num_events_published: int = 0
    num_batches_dropped: int = 0
    """Batches the queue had no room for (the publisher thread fell behind)."""
    num_events_dropped: int = 0
    num_replays: int = 0
    """Replay requests answered."""
    num_errors: int = 0
    """Batches that could not be encoded or sent (logged)."""


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind an address with a wildcard or a local transport, connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes ``EventBatch``es (see the module docstring); ``close`` stops it."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self._topic = config.topic.encode()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._counts_lock = threading.Lock()
        self._counts = PublisherCounters()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise ValueError(
                f"kv_events_config: cannot open {config.endpoint}"
                + (f" / {config.replay_endpoint}" if config.replay_endpoint else "")
                + f": {self._start_error}"
            ) from self._start_error
        logger.info(
            "KV events published on %s (topic %r)%s",
            config.endpoint,
            config.topic,
            f", replay on {config.replay_endpoint}" if config.replay_endpoint else "",
        )

    # -- the engine's side ---------------------------------------------------------------
    def publish(self, batch: EventBatch) -> bool:
        """Hand ``batch`` to the publisher thread; False (counted) if its queue is full. Never waits."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._count(num_batches_dropped=1, num_events_dropped=len(batch.events))
            return False
        return True

    @property
    def counters(self) -> PublisherCounters:
        with self._counts_lock:
            return self._counts

    def close(self) -> None:
        """Send what is queued (for a moment), then stop the thread and close the sockets."""
        with contextlib.suppress(queue.Full):  # a stuck thread: the stop flag ends it instead
            self._queue.put(None, timeout=_STOP_S)
        self._stop.set()
        self._thread.join(_STOP_S)

    # -- the publisher thread ------------------------------------------------------------
    def _count(self, **increments: int) -> None:
        with self._counts_lock:
            current = self._counts
            self._counts = dataclasses.replace(
                current, **{name: getattr(current, name) + n for name, n in increments.items()}
            )

    def _run(self) -> None:
        context = zmq.Context()
        pub = replay = None
        try:
            try:
                pub = context.socket(zmq.PUB)
                pub.set_hwm(self.config.hwm)
                pub.setsockopt(zmq.LINGER, 0)
                if binds(self.config.endpoint):
                    pub.bind(self.config.endpoint)
                else:
                    pub.connect(self.config.endpoint)
                if self.config.replay_endpoint is not None:
                    replay = context.socket(zmq.ROUTER)
                    replay.setsockopt(zmq.LINGER, 0)
                    replay.bind(self.config.replay_endpoint)
            except zmq.ZMQError as exc:
                self._start_error = exc
                return
            finally:
                self._ready.set()
            self._loop(pub, replay)
        finally:
            for socket in (pub, replay):
                if socket is not None:
                    socket.close(linger=0)
            context.term()

    def _loop(self, pub: zmq.Socket[bytes], replay: zmq.Socket[bytes] | None) -> None:
        while True:
            if replay is not None:
                while replay.poll(0):
                    self._answer_replay(replay)
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if batch is None:
                return
            try:
                payload = encode_batch(batch, self.block_size, encoding=self.config.encoding)
                pub.send_multipart((self._topic, batch.seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            except (zmq.ZMQError, ValueError, TypeError):
                logger.exception("KV events: batch %d could not be published", batch.seq)
                self._count(num_errors=1)
                continue
            self._buffer.append((batch.seq, payload))
            self._count(num_batches_published=1, num_events_published=len(batch.events))

    def _answer_replay(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        # A REQ client's request arrives as (identity, b"", start); a DEALER's may lack the b"".
        if len(frames) not in (2, 3) or len(frames[-1]) != 8:
            logger.warning("KV events: ignored a malformed replay request (%d frames)", len(frames))
            return
        route, start = frames[:-1], int.from_bytes(frames[-1], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                replay.send_multipart((*route, self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((*route, b"", END_SEQ, b""))
        self._count(num_replays=1)
