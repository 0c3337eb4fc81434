"""``TieredKV`` on a real CPU KV cache and real files: the wiring, the one-location rule after a
failed read and a recompute, and the whole-cache operations (persist, purge, reset, stats).

A sequence is driven the way the scheduler does it: device lookup, continued from the tiers
by a promotion, then the rest of the prompt "computed" (each block written with a tensor
that names its tokens) and its full blocks cached.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loraplex.storage.kv.block_hash import BlockKey, block_keys, root_key
from loraplex.storage.kv.kv_cache import KVCache
from loraplex.storage.kv.prefix_cache import PrefixHit
from loraplex.storage.kv.tiers import block_codec
from loraplex.storage.kv.tiers.prefix_promotion import finish_promotion, start_promotion, tiered_continuation
from loraplex.storage.kv.tiers.tiered_kv import KVBlockCounts, PersistReport, TieredKV

BS = 4
FP = b"model-A/layout-1"
PROMPT = list(range(100, 113))  # 3 full blocks + 1 token
OTHER = list(range(200, 224))  # 6 full blocks: fills the whole pool
A = b"A" * 32


def make_cache() -> KVCache:
    return KVCache(2, 6, BS, 2, 8, torch.float32, torch.device("cpu"))


def record_bytes(cache: KVCache) -> int:
    return block_codec.record_bytes(cache.layout)


def make_kv(cache: KVCache, disk: Path | None, *, host_blocks: int = 0, disk_blocks: int = 16) -> TieredKV:
    return TieredKV.create(
        cache,
        FP,
        enable_prefix_caching=True,
        host_kv_cache_bytes=host_blocks * cache.layout.bytes_per_block,
        disk_kv_path=disk,
        disk_kv_cache_bytes=disk_blocks * record_bytes(cache) if disk is not None else 0,
    )


@pytest.fixture
def cache() -> KVCache:
    return make_cache()


@pytest.fixture
def kv(cache: KVCache, tmp_path: Path) -> Iterator[TieredKV]:
    tiered = make_kv(cache, tmp_path / "kv")
    yield tiered
    tiered.persist()  # closes the disk tier's workers


def keys(tokens: list[int], owner: bytes = b"") -> list[BlockKey]:
    return block_keys(tokens, BS, root_key(FP), (b"", owner))


def content(cache: KVCache, tokens: list[int], idx: int) -> torch.Tensor:
    """What block ``idx`` of ``tokens`` holds: a value only those tokens give."""
    return torch.full(cache.layout.block_shape, float(sum(tokens[: (idx + 1) * BS]) + idx))


def compute(kv: TieredKV, cache: KVCache, seq_id: int, tokens: list[int], owner: bytes = b"") -> PrefixHit:
    """Admit ``seq_id`` (device hit continued from the tiers), compute the rest, cache it."""
    bm, extra = kv.block_manager, (b"", owner)
    hit = bm.get_computed_blocks(seq_id, tokens, extra, owner)
    run = tiered_continuation(bm, kv.tiers, seq_id, hit) if kv.tiers is not None else []
    if kv.tiers is not None and run:
        pending = start_promotion(bm, kv.tiers, hit, run)
        assert pending is not None
        finish_promotion(bm, pending)
        hit = bm.get_computed_blocks(seq_id, tokens, extra, owner)
    assert bm.allocate_slots(seq_id, hit.num_cached_tokens, len(tokens) - hit.num_cached_tokens, hit) == []
    table = bm.block_table(seq_id)
    for idx in range(hit.num_cached_blocks, len(table)):
        cache.write_blocks([table[idx]], [content(cache, tokens, idx)])
    bm.cache_full_blocks(seq_id, tokens, len(tokens))
    kv.check_integrity()
    return hit


def device_block(cache: KVCache, block_id: int) -> torch.Tensor:
    out = torch.empty(cache.layout.block_shape)
    cache.read_blocks([block_id], [out])
    return out


def prompt_on_disk(kv: TieredKV, cache: KVCache) -> None:
    """PROMPT computed, freed, then evicted to disk by OTHER (writes flushed)."""
    compute(kv, cache, 1, PROMPT)
    kv.block_manager.free(1)
    compute(kv, cache, 2, OTHER)  # takes all 6 blocks: PROMPT's three go down
    kv.block_manager.free(2)
    assert kv.tiers is not None
    kv.tiers.flush()
    assert [kv.tiers.location(k) is not None for k in keys(PROMPT)] == [True] * 3


@pytest.mark.parametrize("wired", [True, False])
def test_a_failed_read_then_a_recompute_keeps_one_location(
    kv: TieredKV, cache: KVCache, tmp_path: Path, wired: bool
) -> None:
    """PROMPT's blocks on disk, the second record corrupt: the promotion loads the first, the
    chain stops at the second (a miss), the third stays on disk. The sequence computes the
    second and third again; caching the third on the device drops its disk copy. Unwired (the
    hook removed), that copy stays, and the integrity check catches the second location."""
    prompt_on_disk(kv, cache)
    assert kv.tiers is not None and kv.tiers.disk is not None
    k0, k1, k2 = keys(PROMPT)
    slot = kv.tiers.disk.slot_of(k1)
    assert slot is not None
    path = tmp_path / "kv" / f"slot_{slot:06d}.kvb"
    data = bytearray(path.read_bytes())
    data[block_codec.HEADER_BYTES + 7] ^= 1
    path.write_bytes(bytes(data))
    if not wired:
        kv.block_manager.pool.on_cache = None  # a planted duplicate: nobody drops the copy below

    bm = kv.block_manager
    hit = bm.get_computed_blocks(3, PROMPT, (b"", b""))
    run = tiered_continuation(bm, kv.tiers, 3, hit)
    assert run == [k0, k1, k2]
    pending = start_promotion(bm, kv.tiers, hit, run)
    assert pending is not None and finish_promotion(bm, pending) == 1
    assert kv.tiers.location(k1) is None and kv.tiers.location(k2) is not None  # 2 stays below
    hit = bm.get_computed_blocks(3, PROMPT, (b"", b""))
    assert hit.num_cached_blocks == 1 and torch.equal(
        device_block(cache, hit.block_ids[0]), content(cache, PROMPT, 0)
    )
    bm.allocate_slots(3, hit.num_cached_tokens, len(PROMPT) - hit.num_cached_tokens, hit)
    bm.cache_full_blocks(3, PROMPT, len(PROMPT))  # 1 and 2 computed again, now cached on the device
    assert bm.pool.cached_keys() >= {k0, k1, k2}
    if wired:
        assert kv.tiers.location(k2) is None and kv.tiers.num_discarded_blocks == 1
        kv.check_integrity()
    else:
        with pytest.raises(AssertionError, match="device blocks also live below"):
            kv.check_integrity()


def test_a_planted_lower_copy_of_a_device_key_fails_the_check(cache: KVCache) -> None:
    kv = make_kv(cache, None, host_blocks=4)
    compute(kv, cache, 1, PROMPT)
    assert kv.tiers is not None
    key = keys(PROMPT)[1]
    kv.tiers.host.put(key, content(cache, PROMPT, 1))  # behind the facade's back
    with pytest.raises(AssertionError, match="device blocks also live below"):
        kv.check_integrity()
    kv.tiers.discard([key])
    kv.check_integrity()


def test_persist_keeps_cached_blocks_with_their_owners_for_a_restart(
    kv: TieredKV, cache: KVCache, tmp_path: Path
) -> None:
    """At shutdown the device's cached blocks go to disk with their owner, so a purge after a
    restart still finds a tenant's blocks; the tiers are closed and detached."""
    compute(kv, cache, 1, PROMPT, A)
    compute(kv, cache, 2, PROMPT[:5])  # nobody's: 1 full block, still in use
    assert kv.persist() == PersistReport(num_cached=4, num_kept=4, num_spilled=0)
    assert kv.tiers is None and kv.block_manager.pool.on_evict is None
    kv.check_integrity()  # the device blocks are still cached; no tier to check against
    assert kv.persist() == PersistReport(0, 0, 0)

    again = make_kv(make_cache(), tmp_path / "kv")
    try:
        assert again.tiers is not None and again.tiers.disk is not None
        assert [again.tiers.disk.owner_of(k) for k in keys(PROMPT, A)] == [A] * 3
        assert again.purge(A) == (0, 0, 3)
        assert again.block_counts().num_used_disk_blocks == 1  # nobody's block remains
        again.check_integrity()
    finally:
        again.persist()


def test_purge_and_reset_reach_every_tier(cache: KVCache, tmp_path: Path) -> None:
    """A tenant's blocks on the device, in host RAM and on disk are purged; a reset forgets
    every tier. Block counts follow the eviction order exactly."""
    kv = make_kv(cache, tmp_path / "kv", host_blocks=2)
    try:
        compute(kv, cache, 1, PROMPT, A)
        kv.block_manager.free(1)
        compute(kv, cache, 2, OTHER)  # PROMPT's blocks go down: 2 to host, then 0 (2 to disk)
        kv.block_manager.free(2)
        counts = kv.block_counts()
        assert (counts.num_used_host_blocks, counts.num_used_disk_blocks) == (2, 1)
        assert counts.num_cached_device_blocks == 6
        compute(kv, cache, 3, PROMPT[:9], A)  # promotes A's first two back to the device
        kv.block_manager.free(3)
        assert kv.purge(A) == (2, 0, 1)  # those two on the device, the third on disk
        assert kv.tiers is not None and kv.tiers.lookup(keys(PROMPT, A)) == []
        kv.check_integrity()
        counts = kv.block_counts()
        assert counts.num_cached_device_blocks == 3  # OTHER's last three
        assert (counts.num_used_host_blocks, counts.num_used_disk_blocks) == (1, 2)
        # Nobody's: 4 blocks, the 3 keyless ones first (the 2 purged and step 3's partial
        # one), then one eviction: OTHER's oldest goes to host.
        compute(kv, cache, 4, PROMPT)
        kv.block_manager.free(4)
        counts = kv.block_counts()
        assert counts.num_cached_device_blocks == 5
        assert (counts.num_used_host_blocks, counts.num_used_disk_blocks) == (2, 2)
        assert kv.reset() == (5, 2, 2)
        counts = kv.block_counts()
        assert (
            counts.num_cached_device_blocks,
            counts.num_used_host_blocks,
            counts.num_used_disk_blocks,
        ) == (
            0,
            0,
            0,
        )
        kv.check_integrity()
    finally:
        kv.persist()


def test_without_tiers_the_cache_is_the_device_pool(cache: KVCache) -> None:
    kv = make_kv(cache, None)
    assert kv.tiers is None and not kv.can_swap and kv.block_manager.pool.on_evict is None
    compute(kv, cache, 1, PROMPT, A)
    assert kv.block_counts() == KVBlockCounts(6, 4, 0, 3, 0, 0, 0, 0, 0)
    assert [m.capacity_blocks for m in kv.tier_metrics()] == [0, 0]
    assert kv.prefix_cache_stats().num_cached_blocks == 3
    assert kv.purge(A) == (0, 0, 0)  # in use: they keep their keys (until reused)
    kv.block_manager.free(1)
    assert kv.reset() == (3, 0, 0)
    assert kv.persist() == PersistReport(0, 0, 0)
    kv.check_integrity()
