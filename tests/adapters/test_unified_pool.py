"""Adapter pages in the KV cache's own pool (``KVPageArena``): the pages are views of the top KV
blocks, hold the same weights as pages of their own memory, and give their blocks back to the
KV cache (evicting only unpinned adapters) without losing a pinned adapter's weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.adapters import make_adapter

from loraplex.adapters import GROUPS, AdapterManager, BaseModelSpec, LoRARequest, NoFreeSlotError
from loraplex.storage.kv.block_manager import KVBlockManager
from loraplex.storage.kv.kv_arena import KVPageArena
from loraplex.storage.kv.kv_cache import KVCache

NUM_BLOCKS = 256
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("unified")
    out = {i: make_adapter(root / f"a{i}", seed=10 + i, r=2 + 2 * i) for i in (1, 2, 3)}
    out[4] = make_adapter(root / "a4", seed=14, r=3, target_modules=["q_proj", "v_proj"])
    return out


def _kv(spec: BaseModelSpec) -> tuple[KVCache, KVBlockManager]:
    # Any block shape will do: the arena needs the layer count and a block's bytes.
    cache = KVCache(spec.num_layers, NUM_BLOCKS, BLOCK_SIZE, 2, 16, torch.float32, torch.device("cpu"))
    return cache, KVBlockManager(NUM_BLOCKS, BLOCK_SIZE)


def _shared(
    make_manager: Any, spec: BaseModelSpec, adapters: dict[int, Path], reserve_blocks: int = 0
) -> tuple[KVCache, KVBlockManager, KVPageArena, AdapterManager]:
    """A KV pool, its arena (half the pool at most) and a manager with the adapters registered."""
    cache, kv = _kv(spec)
    arena = KVPageArena(cache, kv.pool, cap_blocks=NUM_BLOCKS // 2, reserve_blocks=reserve_blocks)
    manager = make_manager(max_loras=None, lora_page_rank=4, arena=arena)
    _add(manager, adapters)
    return cache, kv, arena, manager


def _add(manager: AdapterManager, adapters: dict[int, Path]) -> None:
    for i, path in adapters.items():
        manager.add_lora(LoRARequest(f"a{i}", i, str(path)))


def _logical(manager: AdapterManager, adapter_id: int) -> dict[tuple[int, str], torch.Tensor]:
    """The adapter's pages in every layer and group, in the logical layout, concatenated."""
    pages = manager.pages_of(adapter_id)
    assert pages is not None
    out = {}
    for layer in range(manager.spec.num_layers):
        for group, ids in pages.items():
            buf = manager.get_logical_buffers(layer, group)
            index = torch.tensor(ids)
            out[(layer, group)] = torch.cat([buf.lora_a[:, index].flatten(), buf.lora_b[:, index].flatten()])
    return out


def _inside(t: torch.Tensor, cache: KVCache, layer: int, first_block: int) -> bool:
    """Whether ``t``'s bytes lie in ``layer``'s K or V cache at or above ``first_block``."""
    for kv in (cache.k[layer], cache.v[layer]):
        start = kv.data_ptr() + first_block * kv[0].nbytes
        if start <= t.data_ptr() and t.data_ptr() + t.nbytes <= kv.data_ptr() + kv.nbytes:
            return True
    return False


def test_pages_live_in_the_top_kv_blocks_and_match_own_memory(
    adapters: dict[int, Path], make_manager: Any, spec: BaseModelSpec
) -> None:
    cache, kv, arena, shared = _shared(make_manager, spec, adapters)
    own = make_manager(max_loras=None, lora_page_rank=4, store_dir=None)
    _add(own, adapters)
    for manager in (shared, own):
        for i in adapters:
            manager.acquire(i, f"r{i}")
    assert kv.pool.num_lent > 0 and arena.num_blocks == kv.pool.num_lent
    for layer in range(spec.num_layers):
        for group in GROUPS:
            buf = shared.get_buffers(layer, group)
            if buf.lora_a.numel():
                assert _inside(buf.lora_a, cache, layer, kv.pool.limit)
                assert _inside(buf.lora_b, cache, layer, kv.pool.limit)
    for i in adapters:
        want, got = _logical(own, i), _logical(shared, i)
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want)
    shared.check_integrity()
    kv.check_integrity()  # KV in use + free + lent = the pool
    # Sequences never get a lent block.
    assert kv.allocate_slots(1, 0, kv.pool.num_free_blocks * BLOCK_SIZE) is not None
    assert max(kv.block_table(1)) < kv.pool.limit
    kv.free(1)


def test_blocks_go_back_to_the_kv_cache_only_from_unpinned_adapters(
    adapters: dict[int, Path], make_manager: Any, spec: BaseModelSpec
) -> None:
    _, kv, _, manager = _shared(make_manager, spec, adapters)
    for i in adapters:
        manager.acquire(i, f"r{i}")
    pinned = _logical(manager, 3)
    for i in (1, 2, 4):
        manager.release(f"r{i}")
    # Everything: more than the unpinned adapters hold, so nothing happens (a partial return
    # would cost reloads and a re-layout, and still not be enough).
    lent = kv.pool.num_lent
    assert manager.give_back_memory(lent) == 0
    assert all(manager.is_resident(i) for i in adapters) and kv.pool.num_lent == lent
    # The pools' growth slack (free pages) goes back without an eviction.
    pool = manager._pool
    slack = lent - pool.blocks_for({g: pool.num_used(g) for g in GROUPS})
    assert slack > 0 and manager.give_back_memory(slack) == slack
    assert all(manager.is_resident(i) for i in adapters)
    lent -= slack
    # A few blocks more: unpinned adapters go, least recently used first; adapter 3 stays.
    back = manager.give_back_memory(4)
    assert back >= 4 and kv.pool.num_lent == lent - back
    assert manager.is_resident(3) and not manager.is_resident(1)
    assert manager.stats().num_evictions >= 1
    got = _logical(manager, 3)  # moved down in the arena, the same weights
    assert all(torch.equal(pinned[k], got[k]) for k in pinned)
    manager.check_integrity()
    kv.check_integrity()


def test_adapters_take_only_free_blocks(
    adapters: dict[int, Path], make_manager: Any, spec: BaseModelSpec
) -> None:
    _, kv, arena, manager = _shared(make_manager, spec, adapters, reserve_blocks=2)
    # The KV cache holds all but 3 blocks: the arena may take one (2 stay in reserve).
    assert kv.allocate_slots(1, 0, (NUM_BLOCKS - 3) * BLOCK_SIZE) is not None
    assert arena.max_blocks() == 1
    assert not manager.can_acquire(3)
    with pytest.raises(NoFreeSlotError, match="adapter memory"):
        manager.acquire(3, "r3")
    kv.free(1)
    manager.acquire(3, "r3")
    assert manager.is_resident(3)
    manager.check_integrity()
    kv.check_integrity()
