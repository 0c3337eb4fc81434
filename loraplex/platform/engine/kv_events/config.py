"""``KVEventsConfig``: vLLM's ``--kv-events-config``, the same fields and defaults.

    loraplex serve --kv-events-config '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557",
                                        "replay_endpoint": "tcp://*:5558", "topic": "kv@10.0.0.7@m"}'

Unknown fields are refused with the known ones named (a misspelt field would otherwise turn
events off without a word); so are values that would make the publisher misbehave.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

PublisherName = Literal["null", "zmq"]
PUBLISHERS: tuple[PublisherName, ...] = ("null", "zmq")
EncodingName = Literal["array", "map"]
ENCODINGS: tuple[EncodingName, ...] = ("array", "map")


@dataclass(frozen=True)
class KVEventsConfig:
    """Where and how KV cache events are published (vLLM's ``KVEventsConfig``)."""

    enable_kv_cache_events: bool = False
    """Publish KV cache events (blocks stored, removed, cleared)."""
    publisher: PublisherName | None = None
    """"zmq" (a PUB socket) or "null" (nothing is published); default: zmq when enabled."""
    endpoint: str = "tcp://*:5557"
    """PUB address: bound when it holds ``*``, ``::``, ``ipc://`` or ``inproc://``, else connected."""
    replay_endpoint: str | None = None
    """ROUTER address that answers replay requests (a start sequence number, 8 bytes big-endian)."""
    buffer_steps: int = 10_000
    """Batches kept for replay (one batch per engine step that changed the cache)."""
    hwm: int = 100_000
    """ZeroMQ high-water mark of the PUB socket: past it, a slow subscriber's batches are dropped."""
    max_queue_size: int = 100_000
    """Batches waiting for the publisher thread; past it a step's batch is dropped (counted), never
    waited for."""
    topic: str = ""
    """First frame of every message; subscribers filter on its prefix (llm-d: ``kv@<pod>@<model>``)."""
    encoding: EncodingName = "array"
    """loraplex's own field (vLLM has none): how each event is encoded. "array": positional, as
    vLLM before vllm#42892 and every llm-d decoder; "map": named fields, as vLLM since (the
    batch around them stays an array). See ``wire``."""

    def __post_init__(self) -> None:
        if self.publisher is not None and self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv_events_config.publisher must be one of {PUBLISHERS}, got {self.publisher!r}"
            )
        if self.encoding not in ENCODINGS:
            raise ValueError(f"kv_events_config.encoding must be one of {ENCODINGS}, got {self.encoding!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(
                "kv_events_config.endpoint must be a ZeroMQ address such as tcp://*:5557, "
                f"got {self.endpoint!r}"
            )
        if self.replay_endpoint is not None and "://" not in self.replay_endpoint:
            raise ValueError(
                "kv_events_config.replay_endpoint must be a ZeroMQ address such as tcp://*:5558, "
                f"got {self.replay_endpoint!r}"
            )
        if self.replay_endpoint is not None and self.replay_endpoint == self.endpoint:
            raise ValueError("kv_events_config.replay_endpoint must differ from endpoint")

    @property
    def publishes(self) -> bool:
        """Whether events are published at all (enabled, and the publisher is not "null")."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """The config a JSON object describes (``ValueError`` naming the problem otherwise)."""
        try:
            data: Any = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"kv_events_config must be a JSON object: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"kv_events_config has no field {unknown[0]!r}; its fields: {sorted(known)}")
        return cls(**data)
