"""KV events from a running engine, read by a real ZeroMQ subscriber decoding vLLM's msgpack layout.

What a router relies on: a request's prompt blocks arrive as ``BlockStored`` with their token ids,
the block size and the adapter's name; two tenants sending the same prompt get different block
hashes (and different tenant digests in ``extra_keys``, none of which holds the tenant's id);
evicted blocks come as ``BlockRemoved``, a reset as ``AllBlocksCleared``; a subscriber that asks
gets every buffered batch again, byte for byte the same, and a batch the publisher had no room
for leaves a counted gap in the sequence numbers.
"""

from __future__ import annotations

import itertools
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.adapters import make_small_adapter
from support.kv_events import Cleared, Removed, Stored, Subscriber, events_of
from support.ports import free_port

from loraplex import SamplingParams
from loraplex.adapters import LoRARequest
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.kv_events.config import KVEventsConfig
from loraplex.platform.engine.kv_events.publisher import ZmqEventPublisher
from loraplex.platform.engine.kv_events.wire import EventBatch
from loraplex.storage.kv.kv_events import GPU, BlocksRemoved

BLOCK = 16
PROMPT = [(11 * i) % 400 + 5 for i in range(2 * BLOCK + 3)]  # two full blocks and a tail
TOPIC = "kv@replica-0@tiny"


def _config(
    tiny_dirs: dict[str, Path], endpoint: str, replay: str | None, encoding: str = "array", **extra: object
) -> EngineConfig:
    events = {
        "enable_kv_cache_events": True,
        "endpoint": endpoint,
        "replay_endpoint": replay,
        "topic": TOPIC,
        "encoding": encoding,
    }
    return EngineConfig(
        model=str(tiny_dirs["gqa_tied"]),
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=12,
        max_num_seqs=4,
        enable_lora=True,
        max_lora_rank=8,
        kv_events_config=json.dumps(events),
        **extra,  # type: ignore[arg-type]
    )


@pytest.fixture
def engine_and_subscriber(tiny_dirs: dict[str, Path]) -> Iterator[tuple[LLMEngine, Subscriber]]:
    port, replay_port = free_port(), free_port()
    engine = LLMEngine(_config(tiny_dirs, f"tcp://*:{port}", f"tcp://*:{replay_port}"))
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}", TOPIC, f"tcp://127.0.0.1:{replay_port}")
    try:
        yield engine, subscriber
    finally:
        subscriber.close()
        engine.shutdown()


def _run(engine: LLMEngine, rid: str, prompt: list[int], **kwargs: object) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request(rid, prompt, params, **kwargs)  # type: ignore[arg-type]
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.slow
def test_stored_blocks_carry_tokens_block_size_adapter_and_tenant_digest(
    engine_and_subscriber: tuple[LLMEngine, Subscriber], tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    engine, subscriber = engine_and_subscriber
    adapter = make_small_adapter(tiny_dirs["gqa_tied"], tmp_path / "style")
    lora = LoRARequest("style", 7, str(adapter))
    _run(engine, "a", PROMPT, lora_request=lora, tenant_id="1:acme:1700000000000000")
    batches = subscriber.receive_all()
    assert [b.seq for b in batches] == list(range(len(batches))) and batches
    assert all(b.data_parallel_rank == 0 for b in batches)
    stored = [e for e in events_of(batches) if isinstance(e, Stored) and e.medium == "GPU"]
    assert stored, events_of(batches)
    first = stored[0]
    assert first.parent_block_hash is None and first.block_size == BLOCK
    assert first.token_ids == PROMPT[: BLOCK * len(first.block_hashes)]
    assert first.lora_name == "style" and first.lora_id == 7
    assert first.extra_keys is not None and len(first.extra_keys) == len(first.block_hashes)
    name, digest = first.extra_keys[0]
    assert name == "style" and len(digest) == 32 and "acme" not in digest
    assert all(0 <= h < 2**64 for e in stored for h in e.block_hashes)
    # Every block of the prompt is announced, chained: a later run names its parent.
    hashes = [h for e in stored for h in e.block_hashes]
    assert len(hashes) == len(set(hashes)) >= 2
    for earlier, later in itertools.pairwise(stored):
        assert later.parent_block_hash == earlier.block_hashes[-1]


@pytest.mark.slow
def test_two_tenants_same_prompt_get_distinct_keys(
    engine_and_subscriber: tuple[LLMEngine, Subscriber],
) -> None:
    engine, subscriber = engine_and_subscriber
    _run(engine, "a", PROMPT, tenant_id="1:acme:1")
    _run(engine, "b", PROMPT, tenant_id="2:globex:2")
    _run(engine, "c", PROMPT, tenant_id="2:globex:2")  # hits globex's blocks: nothing new is stored
    per_request: list[Stored] = []
    for event in events_of(subscriber.receive_all()):
        if isinstance(event, Stored) and event.parent_block_hash is None:
            per_request.append(event)
    assert len(per_request) == 2, per_request  # acme's prompt, globex's prompt; c was a hit
    acme, globex = per_request
    assert acme.token_ids == globex.token_ids == PROMPT[: len(acme.token_ids)]
    assert not set(acme.block_hashes) & set(globex.block_hashes)
    assert acme.extra_keys != globex.extra_keys
    assert acme.lora_name is None and acme.extra_keys is not None and len(acme.extra_keys[0]) == 1


@pytest.mark.slow
def test_eviction_reset_and_replay(engine_and_subscriber: tuple[LLMEngine, Subscriber]) -> None:
    engine, subscriber = engine_and_subscriber
    _run(engine, "first", PROMPT)
    live = subscriber.receive_all()
    first_hashes = {h for e in events_of(live) if isinstance(e, Stored) for h in e.block_hashes}
    # 12 blocks in all, two of each prompt cached: six more prompts reuse the oldest cached ones.
    for i in range(6):
        _run(engine, f"other{i}", [t + 500 + 37 * i for t in PROMPT])
    later = subscriber.receive_all()
    live += later
    events = events_of(later)
    removed = {h for e in events if isinstance(e, Removed) and e.medium == "GPU" for h in e.block_hashes}
    assert first_hashes and first_hashes <= removed, "evicted blocks must be announced as removed"
    assert engine.reset_prefix_cache()
    engine.publish_stats()  # the step loop does this after a command; offline, by hand
    cleared = subscriber.receive_all()
    assert [e for e in events_of(cleared)] == [Cleared()]
    # A subscriber that lost track asks for everything still buffered: the same batches.
    replayed = subscriber.request_replay(0)
    assert [(b.seq, b.events) for b in replayed] == [(b.seq, b.events) for b in live + cleared]
    assert subscriber.request_replay(live[-1].seq + 1) == cleared


@pytest.mark.slow
def test_map_encoding_carries_the_same_events_by_name(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    """``encoding: "map"`` (vLLM since vllm#42892): the same events as the array layout, named."""
    adapter = make_small_adapter(tiny_dirs["gqa_tied"], tmp_path / "style")
    seen: dict[str, list[Stored | Removed | Cleared]] = {}
    for encoding in ("array", "map"):
        port = free_port()
        engine = LLMEngine(_config(tiny_dirs, f"tcp://*:{port}", None, encoding))
        subscriber = Subscriber(f"tcp://127.0.0.1:{port}", TOPIC)
        try:
            lora = LoRARequest("style", 7, str(adapter))
            _run(engine, "a", PROMPT, lora_request=lora, tenant_id="1:acme:1700000000000000")
            _run(engine, "b", PROMPT, tenant_id="2:globex:2")
            batches = subscriber.receive_all()
        finally:
            subscriber.close()
            engine.shutdown()
        assert batches and {layout for b in batches for layout in b.layouts} == {encoding}
        seen[encoding] = events_of(batches)
    assert seen["map"] == seen["array"]
    assert any(isinstance(e, Stored) and e.lora_name == "style" for e in seen["map"])
    with pytest.raises(ValueError, match="encoding must be one of"):
        EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "encoding": "json"}')


def test_bad_kv_events_config_is_refused_with_the_field_named(tiny_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="no field 'enable_events'"):
        EngineConfig(kv_events_config='{"enable_events": true}')
    with pytest.raises(ValueError, match="publisher must be one of"):
        EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "publisher": "kafka"}')
    with socket.socket() as taken:  # the replay port is in use: refused at start-up, not later
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        used = taken.getsockname()[1]
        config = KVEventsConfig(True, endpoint=f"tcp://*:{free_port()}", replay_endpoint=f"tcp://*:{used}")
        with pytest.raises(ValueError, match="cannot open"):
            ZmqEventPublisher(config, 16)


@pytest.mark.slow
def test_a_full_queue_drops_batches_counted_and_leaves_a_gap() -> None:
    port = free_port()
    publisher = ZmqEventPublisher(KVEventsConfig(True, endpoint=f"tcp://*:{port}", max_queue_size=1), 16)
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        events = [BlocksRemoved(tuple(bytes([i % 256]) * 32 for i in range(64)), GPU)] * 64
        sent = 2000
        accepted = [publisher.publish(EventBatch(seq, 0.0, events)) for seq in range(sent)]
        received = subscriber.receive_all(quiet_s=1.0)
        counters = publisher.counters
        assert not all(accepted), "the publisher kept up with 2000 batches at once: no drop to see"
        assert counters.num_batches_dropped == accepted.count(False)
        assert counters.num_batches_published == accepted.count(True) == len(received)
        seqs = [b.seq for b in received]
        assert seqs == [seq for seq, ok in enumerate(accepted) if ok]  # the gaps are the drops
    finally:
        subscriber.close()
        publisher.close()
