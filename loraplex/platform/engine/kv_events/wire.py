"""vLLM's KV event wire format: the cache's ``kv_events`` values as one msgpack batch.

vLLM encodes with msgspec ``Struct(array_like=True, omit_defaults=True, tag=True)``: a struct is
an array of its fields in declaration order, a tagged one starts with its class name, and
trailing fields equal to their default are left out. Field order of the release this matches
(``vllm/distributed/kv_events.py``, the array layout that carries ``lora_name`` and
``extra_keys``: after vllm#33304, before vllm#42892 turned events into tagged maps)::

    KVEventBatch     = [ts, [event, ...], data_parallel_rank]
    BlockStored      = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                        lora_id, medium, lora_name, extra_keys]
    BlockRemoved     = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

With ``encoding: "map"`` (vLLM since vllm#42892, merged 2026-06-09) each event is instead a map
of the same fields named, its class name under ``"type"`` and ``extra_keys`` left out when it is
``None``: ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ...,
"token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
"extra_keys": [...]}``; the batch stays the array above (that change left it alone, and llm-d's
decoder reads events of either form inside it).

Block hashes are 64-bit unsigned integers, as vLLM sends them by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the low 64 bits of the 32-byte key read
big-endian. ``extra_keys`` has one entry per block: the adapter's served name (vLLM hashes the
LoRA name) and a digest of the tenant's cache salt (``tenant_digest``: never the tenant's name,
id or key, nor the salt itself), whichever apply; ``None`` for a block of neither. Every block
of a run has the same entry: unlike vLLM's ``cache_salt``, which only the first block hashes,
the tenant salt is part of every key here. ``data_parallel_rank`` is 0 (one engine per replica).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from loraplex.storage.kv.kv_events import AllCleared, BlocksRemoved, BlocksStored, KVEvent

_HASH_MASK = (1 << 64) - 1
_DIGEST_TAG = b"loraplex-kv-events-tenant/1\x00"


def external_hash(key: bytes) -> int:
    """A block key as vLLM publishes block hashes: its low 64 bits, read big-endian."""
    return int.from_bytes(key, "big") & _HASH_MASK


def tenant_digest(owner: bytes) -> str:
    """What a router learns of a tenant: 16 bytes of sha256 over the cache salt, in hex.

    The salt is already a digest of the tenant's id, name and creation time; hashing it again
    under a tag keeps the published value useless for anything but telling tenants apart.
    """
    return hashlib.sha256(_DIGEST_TAG + owner).hexdigest()[:32]


@dataclass(frozen=True)
class EventBatch:
    """One engine step's events, on their way to the publisher thread."""

    seq: int
    """The batch's sequence number (consecutive; a dropped batch leaves a gap subscribers see)."""
    ts: float
    """Unix time the step ended."""
    events: Sequence[KVEvent]


def _stored(event: BlocksStored, block_size: int) -> list[object]:
    lora_name, lora_id = event.origin
    extra: list[object] = []
    if lora_name is not None:
        extra.append(lora_name)
    if event.owner:
        extra.append(tenant_digest(event.owner))
    entry = extra or None
    return [
        "BlockStored",
        [external_hash(k) for k in event.keys],
        None if event.parent is None else external_hash(event.parent),
        list(event.token_ids),
        block_size,
        lora_id,
        event.medium,
        lora_name,
        [entry] * len(event.keys),
    ]


_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
"""Each event's fields in declaration order (vLLM's ``BlockStored``, ``BlockRemoved``, ...)."""
_DEFAULT_NONE = frozenset({"extra_keys"})
"""Fields with a default (``None``), which msgspec's ``omit_defaults`` leaves out of a map."""


def encode_event(event: KVEvent, block_size: int) -> list[object]:
    """One event in vLLM's array layout (the module docstring)."""
    if isinstance(event, BlocksStored):
        return _stored(event, block_size)
    if isinstance(event, BlocksRemoved):
        return ["BlockRemoved", [external_hash(k) for k in event.keys], event.medium]
    if isinstance(event, AllCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def as_map(array: list[object]) -> dict[str, object]:
    """An event of the array layout as the map layout: the tag under "type", fields by name."""
    tag = array[0]
    if not isinstance(tag, str) or tag not in _FIELDS:
        raise TypeError(f"not a KV event: {array!r}")
    mapped: dict[str, object] = {"type": tag}
    for name, value in zip(_FIELDS[tag], array[1:], strict=True):
        if value is None and name in _DEFAULT_NONE:
            continue
        mapped[name] = value
    return mapped


def encode_batch(
    batch: EventBatch, block_size: int, data_parallel_rank: int = 0, encoding: str = "array"
) -> bytes:
    """The msgpack payload of one batch (the last frame of a published message)."""
    events: list[object] = [encode_event(event, block_size) for event in batch.events]
    if encoding == "map":
        events = [as_map(event) for event in events]  # type: ignore[arg-type]
    return msgpack.packb([batch.ts, events, data_parallel_rank], use_bin_type=True)
