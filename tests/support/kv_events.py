"""A KV event subscriber as a router writes one: pyzmq SUB + a replay DEALER, msgpack decoding.

It decodes vLLM's array layout by position, the way llm-d's and AIBrix's subscribers do, so a
field out of place fails here too; and events in vLLM's map layout (since vllm#42892) by name,
with no field beyond vLLM's. Not a copy of the server's encoder: nothing is imported from
``loraplex``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class Stored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None


@dataclass(frozen=True)
class Removed:
    block_hashes: list[int]
    medium: str | None


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
)


def decode_map_event(raw: dict[str, Any]) -> Event:
    tag = raw["type"]
    if tag == "BlockStored":
        assert set(raw) - {"type"} <= set(STORED_FIELDS) and set(STORED_FIELDS[:7]) <= set(raw), raw
        return Stored(*(raw.get(name) for name in STORED_FIELDS))
    if tag == "BlockRemoved":
        assert set(raw) == {"type", "block_hashes", "medium"}, raw
        return Removed(raw["block_hashes"], raw["medium"])
    assert raw == {"type": "AllBlocksCleared"}, raw
    return Cleared()


def decode_event(raw: list[Any] | dict[str, Any]) -> Event:
    if isinstance(raw, dict):
        return decode_map_event(raw)
    tag, fields = raw[0], raw[1:]
    if tag == "BlockStored":
        assert 5 <= len(fields) <= 8, raw
        padded = [*fields, *([None] * (8 - len(fields)))]
        return Stored(*padded)
    if tag == "BlockRemoved":
        assert 1 <= len(fields) <= 2, raw
        return Removed(fields[0], fields[1] if len(fields) > 1 else None)
    assert tag == "AllBlocksCleared" and not fields, raw
    return Cleared()


@dataclass(frozen=True)
class Batch:
    seq: int
    ts: float
    events: list[Event]
    data_parallel_rank: int | None
    layouts: frozenset[str] = frozenset()
    """How its events came: "array", "map" (both would be a publisher bug)."""


def decode_batch(seq_bytes: bytes, payload: bytes) -> Batch:
    decoded = msgpack.unpackb(payload, raw=False)
    assert isinstance(decoded, list) and len(decoded) in (2, 3), decoded
    rank = decoded[2] if len(decoded) == 3 else None
    layouts = frozenset("map" if isinstance(e, dict) else "array" for e in decoded[1])
    events = [decode_event(e) for e in decoded[1]]
    return Batch(int.from_bytes(seq_bytes, "big"), decoded[0], events, rank, layouts)


class Subscriber:
    """SUB on ``endpoint`` for ``topic``; a DEALER on ``replay`` when given."""

    def __init__(self, endpoint: str, topic: str = "", replay: str | None = None) -> None:
        self.context = zmq.Context()
        self.topic = topic.encode()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(endpoint)
        self.replay = None
        if replay is not None:
            self.replay = self.context.socket(zmq.DEALER)
            self.replay.connect(replay)
        time.sleep(0.3)  # ZeroMQ's slow joiner: a SUB hears only what is sent after it joined

    def receive(self, timeout_s: float = 5.0) -> Batch | None:
        if not self.sub.poll(int(timeout_s * 1000)):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == self.topic
        return decode_batch(seq, payload)

    def receive_all(self, quiet_s: float = 0.5) -> list[Batch]:
        """Every batch until none came for ``quiet_s``."""
        out = []
        while (batch := self.receive(quiet_s)) is not None:
            out.append(batch)
        return out

    def request_replay(self, start_seq: int, timeout_s: float = 5.0) -> list[Batch]:
        assert self.replay is not None
        self.replay.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        while True:
            assert self.replay.poll(int(timeout_s * 1000)), "the replay never ended"
            frames = self.replay.recv_multipart()
            assert frames[0] == b"", frames  # the REQ-style delimiter, then vLLM's three frames
            topic, seq, payload = frames[1:]
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                return out
            assert topic == self.topic
            out.append(decode_batch(seq, payload))

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
        self.context.term()


def events_of(batches: list[Batch]) -> list[Event]:
    return [event for batch in batches for event in batch.events]
