"""KV events from a real ``TieredKV`` (CPU KV cache, real host pool and disk files): every block that
becomes findable or stops being findable in a tier is reported once, in that tier, with what a
router keys it by (the run's tokens and parent, the owner, the adapter), and nothing else is.

The expected events are derived from the keys ``block_keys`` computes for the prompts, never
from the log itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_tiered_kv import BS, FP, OTHER, PROMPT, compute, make_kv

from loraplex.storage.kv.block_hash import BlockKey, block_keys, root_key
from loraplex.storage.kv.kv_cache import KVCache
from loraplex.storage.kv.kv_events import (
    CPU,
    GPU,
    STORAGE,
    AllCleared,
    BlockOrigin,
    BlocksRemoved,
    BlocksStored,
    KVEvent,
    KVEventLog,
)
from loraplex.storage.kv.tiers.tiered_kv import TieredKV

OWNER = b"o" * 32
ORIGIN = BlockOrigin("style", 7)


def make_cache(num_blocks: int = 6) -> KVCache:
    return KVCache(2, num_blocks, BS, 2, 8, torch.float32, torch.device("cpu"))


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[TieredKV, KVCache, KVEventLog]]:
    cache = make_cache()
    kv = make_kv(cache, tmp_path / "kv", host_blocks=2, disk_blocks=16)
    log = KVEventLog(enabled=True)
    kv.attach_events(log)
    yield kv, cache, log
    kv.persist()


def keys_of(tokens: list[int], owner: bytes = b"") -> list[BlockKey]:
    return block_keys(tokens, BS, root_key(FP), (b"", owner))


def by_medium(events: list[KVEvent], kind: type, medium: str) -> list[bytes]:
    """Every key the ``kind`` events of ``medium`` name, in order."""
    return [k for e in events if isinstance(e, kind) and e.medium == medium for k in e.keys]


def test_registered_blocks_are_one_stored_run_with_tokens_parent_owner_and_origin() -> None:
    kv = TieredKV.create(make_cache(8), FP, enable_prefix_caching=True)
    log = KVEventLog(enabled=True)
    kv.attach_events(log)
    bm, extra = kv.block_manager, (b"", OWNER)
    hit = bm.get_computed_blocks(1, PROMPT, extra, OWNER, ORIGIN)
    bm.allocate_slots(1, 0, len(PROMPT), hit)
    bm.cache_full_blocks(1, PROMPT, 8)  # two blocks computed
    bm.cache_full_blocks(1, PROMPT, len(PROMPT))  # the third
    expected = keys_of(PROMPT, OWNER)
    assert log.take() == [
        BlocksStored(tuple(expected[:2]), None, tuple(PROMPT[:8]), GPU, OWNER, ORIGIN),
        BlocksStored((expected[2],), expected[1], tuple(PROMPT[8:12]), GPU, OWNER, ORIGIN),
    ]
    # A second sequence with the same prompt hits them: nothing new is stored, nothing reported.
    again = bm.get_computed_blocks(2, PROMPT, extra, OWNER, ORIGIN)
    assert again.num_cached_blocks == 3
    bm.allocate_slots(2, again.num_cached_tokens, len(PROMPT) - again.num_cached_tokens, again)
    bm.cache_full_blocks(2, PROMPT, len(PROMPT))
    assert log.take() == []


def test_a_disabled_log_records_nothing() -> None:
    kv = TieredKV.create(make_cache(8), FP, enable_prefix_caching=True)
    log = KVEventLog(enabled=False)
    kv.attach_events(log)
    bm = kv.block_manager
    hit = bm.get_computed_blocks(1, PROMPT, (b"", b""))
    bm.allocate_slots(1, 0, len(PROMPT), hit)
    bm.cache_full_blocks(1, PROMPT, len(PROMPT))
    assert len(log) == 0


def test_eviction_demotion_and_promotion_are_reported_in_each_tier(
    setup: tuple[TieredKV, KVCache, KVEventLog],
) -> None:
    kv, cache, log = setup
    prompt_keys = keys_of(PROMPT)
    compute(kv, cache, 1, PROMPT)
    kv.block_manager.free(1)
    stored = log.take()
    assert by_medium(stored, BlocksStored, GPU) == prompt_keys
    # OTHER takes the whole pool: PROMPT's three cached blocks are evicted from the device,
    # two fit the host pool (2 slots), the third pushes the least recently used one to disk.
    compute(kv, cache, 2, OTHER)
    kv.block_manager.free(2)
    events = log.take()
    assert sorted(by_medium(events, BlocksRemoved, GPU)) == sorted(prompt_keys)
    assert sorted(by_medium(events, BlocksStored, CPU)) == sorted(prompt_keys)
    pushed = by_medium(events, BlocksRemoved, CPU)
    assert len(pushed) == 1 and pushed == by_medium(events, BlocksStored, STORAGE)
    assert by_medium(events, BlocksStored, GPU) == keys_of(OTHER)
    # Where each key is now agrees with what the events said.
    assert {kv.tiers.location(k).tier.value for k in prompt_keys} == {"host", "disk"}  # type: ignore[union-attr]
    # PROMPT again: its blocks are promoted back; each leaves its tier and arrives on the device.
    compute(kv, cache, 3, PROMPT)
    events = log.take()
    left = by_medium(events, BlocksRemoved, CPU) + by_medium(events, BlocksRemoved, STORAGE)
    assert sorted(left) == sorted(prompt_keys)
    promoted = [e for e in events if isinstance(e, BlocksStored) and e.medium == GPU]
    assert sorted(k for e in promoted for k in e.keys) == sorted(prompt_keys)
    assert all(e.token_ids == () and e.parent is None for e in promoted)  # not known on a promotion


def test_purge_reports_the_owner_blocks_and_reset_is_one_all_cleared(
    setup: tuple[TieredKV, KVCache, KVEventLog],
) -> None:
    kv, cache, log = setup
    compute(kv, cache, 1, PROMPT, OWNER)
    kv.block_manager.free(1)
    compute(kv, cache, 2, OTHER)  # pushes the owner's blocks down to host and disk
    kv.block_manager.free(2)
    log.take()
    kv.purge(OWNER)
    events = log.take()
    gone = by_medium(events, BlocksRemoved, CPU) + by_medium(events, BlocksRemoved, STORAGE)
    assert sorted(gone) == sorted(keys_of(PROMPT, OWNER))
    assert not any(isinstance(e, BlocksStored) for e in events)
    kv.reset()
    assert log.take() == [AllCleared()]  # the device's blocks and the tiers': one event


def test_swap_blocks_are_never_reported(setup: tuple[TieredKV, KVCache, KVEventLog]) -> None:
    kv, cache, log = setup
    compute(kv, cache, 1, PROMPT)
    log.take()
    assert kv.tiers is not None
    handle = kv.tiers.swap_out(kv.block_manager.block_table(1)[:2])
    assert handle is not None
    kv.tiers.discard_swap(handle)
    assert log.take() == []
