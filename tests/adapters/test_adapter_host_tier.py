"""The host tier: the LRU bounded by bytes, store re-reads by content hash, read-ahead."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.adapters import edit_tensors, key, make_adapter

from loraplex.adapters import AdapterManager, AdapterValidationError, LoRARequest
from loraplex.adapters.host_cache import HostAdapterCache
from loraplex.adapters.loader import read_adapter, reread_adapter


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Six different adapters, ids 1..6 (ranks 2..4)."""
    root = tmp_path_factory.mktemp("adapters")
    return {i: make_adapter(root / f"a{i}", seed=i, r=2 + i % 3) for i in range(1, 7)}


def _add(manager: AdapterManager, adapters: dict[int, Path], *ids: int) -> None:
    for i in ids:
        manager.add_lora(LoRARequest(f"a{i}", i, str(adapters[i])))


def _weights(adapters: dict[int, Path], spec: Any, i: int) -> Any:
    return read_adapter(adapters[i], spec, 8, torch.float32).weights


def test_host_lru_is_bounded_by_bytes(adapters: dict[int, Path], spec: Any) -> None:
    ws = {i: _weights(adapters, spec, i) for i in (1, 2, 3)}
    budget = ws[1].nbytes + ws[2].nbytes
    cache = HostAdapterCache(capacity=None, max_bytes=budget)
    assert cache.put("v1", ws[1]) == [] and cache.put("v2", ws[2]) == []
    assert cache.nbytes == budget
    cache.get("v1")  # v2 is now the least recently used
    assert cache.put("v3", ws[3]) == ["v2"]  # rank 2 fits where the rank-4 v2 was
    assert cache.nbytes <= budget and "v3" in cache and cache.check() == []
    cache.put("v3", ws[3])  # refreshing does not count twice
    assert cache.nbytes == sum(ws[int(v[1])].nbytes for v in cache.versions())
    # One entry larger than the whole budget stays alone (the newest is always kept).
    tiny = HostAdapterCache(capacity=None, max_bytes=1)
    assert tiny.put("v1", ws[1]) == [] and tiny.put("v2", ws[2]) == ["v1"]
    assert tiny.versions() == ["v2"] and tiny.check() == []
    cache.discard("v3")
    assert cache.nbytes == sum(ws[int(v[1])].nbytes for v in cache.versions())
    with pytest.raises(ValueError, match="max_bytes"):
        HostAdapterCache(capacity=None, max_bytes=0)


def test_manager_host_tier_in_bytes(adapters: dict[int, Path], spec: Any, make_manager: Any) -> None:
    one = _weights(adapters, spec, 1).nbytes
    manager = make_manager(max_loras=None, max_cpu_loras=None, cpu_lora_memory=int(2.5 * one))
    _add(manager, adapters, 1, 2, 3, 4, 5, 6)
    stats = manager.stats()
    assert stats.host_capacity is None and stats.host_budget_bytes == int(2.5 * one)
    # The LRU keeps the most recently registered adapters that fit the bytes, newest first.
    sizes = [_weights(adapters, spec, i).nbytes for i in (6, 5, 4, 3, 2, 1)]
    kept, total = 0, 0
    while kept < 6 and total + sizes[kept] <= int(2.5 * one):
        total += sizes[kept]
        kept += 1
    assert stats.num_in_host == kept and stats.host_bytes == total
    manager.check_integrity()


def test_reread_checks_the_hash_and_returns_the_validated_weights(
    adapters: dict[int, Path], spec: Any, tmp_path: Path
) -> None:
    parsed = read_adapter(adapters[2], spec, 8, torch.float32)
    again = reread_adapter(adapters[2], spec, 8, torch.float32, parsed.version)
    assert again.version == parsed.version
    assert again.weights.modules.keys() == parsed.weights.modules.keys()
    for k, m in parsed.weights.modules.items():
        n = again.weights.modules[k]
        assert torch.equal(m.lora_a, n.lora_a) and torch.equal(m.lora_b, n.lora_b) and m.scaling == n.scaling
    # Values the checks would refuse (NaN) are not trusted: the hash no longer matches.
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in adapters[2].iterdir():
        (copy / f.name).write_bytes(f.read_bytes())

    def poison(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key(0, "q_proj")][0, 0] = float("nan")

    edit_tensors(copy, poison)
    with pytest.raises(AdapterValidationError) as info:
        reread_adapter(copy, spec, 8, torch.float32, parsed.version)
    assert info.value.reason == "changed_on_disk"
    (copy / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterValidationError) as info:
        reread_adapter(copy, spec, 8, torch.float32, parsed.version)
    assert info.value.reason == "changed_on_disk"


def test_read_ahead_follows_the_queue_and_cancels_stale_reads(
    adapters: dict[int, Path], make_manager: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = make_manager(max_loras=None, max_cpu_loras=8)  # read-ahead: up to 4 adapters
    _add(manager, adapters, 1, 2, 3, 4, 5, 6)
    for i in (1, 2, 3, 4, 5):  # as if they had fallen out of the host LRU
        manager._host.discard(manager.get_adapter(i).version)
    gate = threading.Event()
    started: list[str] = []
    real_load = manager._store.load

    def gated_load(folder: Path, *args: Any, **kwargs: Any) -> Any:
        started.append(folder.name)
        assert gate.wait(30)
        return real_load(folder, *args, **kwargs)

    monkeypatch.setattr(manager._store, "load", gated_load)
    manager.prefetch_ahead([1, 2, 3, 6])  # 6 is in host memory: nothing to read
    assert manager.stats().num_loading == 3
    deadline = time.monotonic() + 10
    while not started:  # the one loader thread took adapter 1's read; 2 and 3 queue
        assert time.monotonic() < deadline
        time.sleep(0.01)
    manager.prefetch_ahead([4, 2])  # 1 and 3 were admitted or aborted meanwhile
    assert manager.stats().num_loading == 3  # 1 (running: not cancellable), 4, 2; 3 cancelled
    gate.set()
    deadline = time.monotonic() + 30
    while manager.stats().num_loading:
        manager.prefetch_ahead([4, 2])
        assert time.monotonic() < deadline
        time.sleep(0.01)
    versions = {i: manager.get_adapter(i).version for i in (1, 2, 3, 4)}
    assert started == [versions[i] for i in (1, 2, 4)]  # in queue order; 3 never read
    for i in (1, 2, 4):
        assert manager.can_acquire(i)  # read into host memory, nothing synchronous left
    assert not manager.can_acquire(3)
    manager.check_integrity()


def test_read_ahead_counts_what_is_already_read(adapters: dict[int, Path], make_manager: Any) -> None:
    """Adapters read ahead but not yet used count against the bounds: reading on past them
    would push them out of the host cache before their requests run (a read storm)."""
    manager = make_manager(max_loras=None, max_cpu_loras=4)  # read-ahead: 2 adapters
    _add(manager, adapters, 1, 2, 3, 4, 5, 6)
    for i in (1, 2, 3, 4):
        manager._host.discard(manager.get_adapter(i).version)
    reads = manager.stats().num_disk_reads
    for _ in range(5):  # every step, the same queue: adapters 1 and 2 first
        manager.prefetch_ahead([1, 2, 3, 4])
        while manager.stats().num_loading:
            assert manager.wait_for_a_read(30) or not manager.stats().num_loading
    manager.prefetch_ahead([1, 2, 3, 4])  # collects the last read
    assert manager.stats().num_disk_reads == reads + 2  # 1 and 2, once each; not 3 and 4
    assert manager.can_acquire(1) and manager.can_acquire(2) and not manager.can_acquire(3)
    manager.check_integrity()


def test_a_read_that_finished_before_the_wait_is_news(adapters: dict[int, Path], make_manager: Any) -> None:
    """A read that finished between a request's admission and the idle wait: the wait says so
    at once (True) instead of finding nothing in flight and letting the step go empty (the
    engine's idle step then returned no output for a request whose adapter was in memory)."""
    manager = make_manager(max_loras=None, max_cpu_loras=4)
    _add(manager, adapters, 1)
    manager._host.discard(manager.get_adapter(1).version)
    assert not manager.prefetch(1)  # admission: not in memory, a read starts
    done, _ = concurrent.futures.wait(manager._reads.pending(), timeout=30)
    assert len(done) == 1  # finished, and no manager call has collected it yet
    started = time.monotonic()
    assert manager.wait_for_a_read(30)
    assert time.monotonic() - started < 5  # no wait for a read that is not coming
    assert not manager.wait_for_a_read(0.01)  # nothing new since
    assert manager.can_acquire(1)
    manager.check_integrity()
