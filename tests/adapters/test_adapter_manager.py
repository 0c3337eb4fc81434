"""AdapterManager: tiers, LRU and pins through real adapters, removal while in use, identity."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.adapters import CONFIG, WEIGHTS, edit_tensors, files_under, key, make_adapter

from loraplex.adapters import (
    GROUPS,
    AdapterExistsError,
    AdapterManager,
    AdapterNotFoundError,
    AdapterRemovedError,
    AdapterValidationError,
    BaseModelSpec,
    LoRARequest,
    NoFreeSlotError,
)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Four different adapters, ids 1..4 (adapter 4 targets only q_proj)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {i: make_adapter(root / f"a{i}", seed=i, r=2 + i) for i in (1, 2, 3)}
    out[4] = make_adapter(root / "a4", seed=4, r=2, target_modules=["q_proj"])
    return out


def _add(manager: AdapterManager, adapters: dict[int, Path], *ids: int, owner: str | None = None) -> None:
    for i in ids:
        manager.add_lora(LoRARequest(f"a{i}", i, str(adapters[i])), owner=owner)


def _slot_a(manager: AdapterManager, slot_idx: int) -> torch.Tensor:
    return manager.get_buffers(0, "qkv").lora_a[0, slot_idx].clone()


def test_lru_order_and_exact_slots(adapters: dict[int, Path], make_manager: Any) -> None:
    manager = make_manager(max_loras=2)
    _add(manager, adapters, 1, 2, 3)
    assert manager.acquire(1, "r1") == 0
    assert manager.acquire(2, "r2") == 1
    manager.release("r2")
    manager.release("r1")  # adapter 1 used last: adapter 2 is the LRU
    assert manager.acquire(3, "r3") == 1
    assert manager.slot_of(2) is None and manager.slot_of(3) == 1 and manager.is_resident(1)
    manager.release("r3")
    assert manager.acquire(2, "r4") == 0  # now adapter 1 is the LRU
    assert [a.tier for a in manager.list_adapters()] == ["host", "device", "device"]
    manager.release("r4")
    manager.check_integrity()


def test_pin_count_is_per_request_and_blocks_eviction(adapters: dict[int, Path], make_manager: Any) -> None:
    manager = make_manager(max_loras=2)
    _add(manager, adapters, 1, 2, 3)
    slot_idx = manager.acquire(1, "a")
    assert manager.acquire(1, "b") == slot_idx
    assert manager.acquire(1, "c") == slot_idx
    assert manager.acquire(1, "c") == slot_idx  # idempotent per request
    assert manager.get_adapter(1).num_pins == 3
    manager.acquire(2, "d")
    assert not manager.can_acquire(3)
    with pytest.raises(NoFreeSlotError, match="pinned"):
        manager.acquire(3, "e")
    with pytest.raises(ValueError, match="already holds"):
        manager.acquire(2, "a")
    manager.release("d")
    assert manager.can_acquire(3)
    assert manager.acquire(3, "e") == 1  # evicts adapter 2, never the pinned adapter 1
    for req in ("a", "b", "c", "e"):
        assert manager.release(req)
    assert not manager.release("a")
    assert all(a.num_pins == 0 for a in manager.list_adapters())
    manager.check_integrity()


def test_pages_hold_the_adapter_weights_and_zeros_elsewhere(
    adapters: dict[int, Path], make_manager: Any
) -> None:
    manager = make_manager(max_loras=2, max_lora_rank=8, lora_page_rank=4)
    _add(manager, adapters, 3, 4)
    slot3 = manager.acquire(3, "x")  # rank 5, every module: two pages of 4 rows per group
    manager.release("x")
    manager.acquire(4, "y")  # rank 2, q_proj only: one qkv page, nothing else
    assert manager.acquire(3, "x") == slot3
    pages3, pages4 = manager.pages_of(3), manager.pages_of(4)
    assert pages3 is not None and pages4 is not None
    assert {g: len(p) for g, p in pages3.items()} == {"qkv": 2, "o": 2, "gate_up": 2, "down": 2}
    assert {g: len(p) for g, p in pages4.items()} == {"qkv": 1}
    buf = manager.get_buffers(1, "qkv")
    first, second = pages3["qkv"]
    assert torch.count_nonzero(buf.lora_a[0, first, :4]) > 0
    assert torch.count_nonzero(buf.lora_a[0, second, :1]) > 0  # row 4 of rank 5
    assert torch.count_nonzero(buf.lora_a[:, second, 1:]) == 0  # the rest of the last page
    (page4,) = pages4["qkv"]
    assert torch.count_nonzero(buf.lora_a[1:, page4]) == 0  # adapter 4 does not adapt k/v
    assert torch.count_nonzero(buf.lora_a[0, page4, 2:]) == 0  # rank 2 in a page of 4
    held = sorted([*pages3["qkv"], page4])
    assert [i for i, s in enumerate(buf.scales.tolist()) if s == 1.0] == held
    assert manager.stats().pages_used == {"qkv": 3, "o": 2, "gate_up": 2, "down": 2}
    manager.check_integrity()


def test_memory_not_a_slot_count_bounds_residency(adapters: dict[int, Path], make_manager: Any) -> None:
    """Uncapped (max_loras None): adapters stay resident while their pages fit in lora_memory;
    past it the least recently used unpinned ones are evicted, pinned ones never."""
    probe = make_manager(max_loras=None, lora_page_rank=4)
    # Adapters 1 (rank 3) and 2 (rank 4) take one page per group: room for three such adapters.
    one_adapter = sum(probe._pool.page_nbytes(g) for g in GROUPS)
    manager = make_manager(max_loras=None, lora_page_rank=4, lora_memory=3 * one_adapter)
    _add(manager, adapters, 1, 2, 3, 4)
    manager.acquire(1, "a")
    manager.acquire(2, "b")
    assert manager.is_resident(1) and manager.is_resident(2)
    assert manager.acquire(4, "d") is not None  # q_proj only: one qkv page, fits
    assert not manager.can_acquire(3)  # rank 5: two pages per group, all room pinned
    with pytest.raises(NoFreeSlotError, match="lora_memory"):
        manager.acquire(3, "c")
    manager.release("a")
    manager.release("b")
    assert manager.can_acquire(3)
    manager.acquire(3, "c")  # evicts the LRU unpinned adapters (1, then 2), never pinned 4
    assert manager.is_resident(4) and manager.is_resident(3)
    assert not manager.is_resident(1)
    assert manager.stats().num_evictions >= 1
    assert manager.device_nbytes <= 3 * one_adapter
    manager.check_integrity()


def test_packed_layout_holds_the_same_adapters_as_the_logical_one(
    adapters: dict[int, Path], make_manager: Any, spec: BaseModelSpec
) -> None:
    """The CPU backend's packed slot layout, seen logically, is byte for byte the logical
    layout through loads, evictions into a used slot (cleared first) and partial adapters."""
    from loraplex.kernels.cpu.lora_layout import CPU_PACKED_LAYOUT

    managers = [make_manager(max_loras=2), make_manager(max_loras=2, weight_layout=CPU_PACKED_LAYOUT)]
    for manager in managers:
        _add(manager, adapters, 1, 2, 3, 4)
    # 1 and 3 fill the slots; 4 (q_proj only) evicts 3, then 2 evicts 1.
    script = [("acquire", 1), ("acquire", 3), ("release", 3), ("acquire", 4), ("release", 1), ("acquire", 2)]
    for op, adapter_id in script:
        for manager in managers:
            if op == "acquire":
                manager.acquire(adapter_id, f"r{adapter_id}")
            else:
                manager.release(f"r{adapter_id}")
        logical, packed = managers
        assert packed.get_buffers(0, "qkv").lora_b.dim() == 5  # really the packed layout
        for layer in range(spec.num_layers):
            for group in GROUPS:
                want = logical.get_buffers(layer, group)
                got = packed.get_logical_buffers(layer, group)
                assert torch.equal(got.lora_a, want.lora_a), (op, adapter_id, layer, group)
                assert torch.equal(got.lora_b, want.lora_b), (op, adapter_id, layer, group)
                assert torch.equal(got.scales, want.scales)


def test_no_slot_leak_after_a_random_workload(adapters: dict[int, Path], make_manager: Any) -> None:
    import random

    rng = random.Random(1)
    manager = make_manager(max_loras=2, max_cpu_loras=2)
    _add(manager, adapters, 1, 2, 3, 4)
    running: list[str] = []
    for step in range(300):
        if running and rng.random() < 0.45:
            manager.release(running.pop(rng.randrange(len(running))))
        else:
            adapter_id = rng.randint(1, 4)
            if manager.can_acquire(adapter_id):
                manager.acquire(adapter_id, f"r{step}")
                running.append(f"r{step}")
            else:
                manager.prefetch(adapter_id)
        manager.check_integrity()
    for req in running:
        manager.release(req)
    manager.check_integrity()
    assert all(a.num_pins == 0 for a in manager.list_adapters())


def _paged_rows(manager: AdapterManager, adapter_id: int) -> dict[tuple[int, str], torch.Tensor]:
    """Every layer and group of a resident adapter: its pages' A and B rows, in page order."""
    tables = manager.pages_of(adapter_id)
    assert tables is not None
    out = {}
    for layer in range(manager.spec.num_layers):
        for group, pages in tables.items():
            buf = manager.get_logical_buffers(layer, group)  # type: ignore[arg-type]
            a = torch.cat([buf.lora_a[:, p] for p in pages], dim=1)
            b = torch.cat([buf.lora_b[:, p] for p in pages], dim=2)
            out[(layer, group)] = torch.cat([a.flatten(), b.flatten()])
    return out


@pytest.mark.parametrize("layout", ["logical", "cpu-packed"])
def test_paged_random_workload_keeps_pages_and_weights(
    layout: str, adapters: dict[int, Path], make_manager: Any
) -> None:
    """Uncapped, a budget of about two adapters: random acquires, releases and a removal; the
    integrity check after every operation (no page held twice, pins, scales, budget), and every
    resident adapter's rows equal to what a roomy manager holds for it, through evictions,
    reloads and the compactions that move pages between groups."""
    import random

    from loraplex.kernels.cpu.lora_layout import CPU_PACKED_LAYOUT

    extra = {"weight_layout": CPU_PACKED_LAYOUT} if layout == "cpu-packed" else {}
    roomy = make_manager(max_loras=None, lora_page_rank=2, **extra)
    _add(roomy, adapters, 1, 2, 3, 4)
    want = {}
    for adapter_id in (1, 2, 3, 4):
        roomy.acquire(adapter_id, "probe")
        want[adapter_id] = _paged_rows(roomy, adapter_id)
        roomy.release("probe")
    sizes = sorted(roomy._residency.held_nbytes(roomy.slot_of(a)) for a in (1, 2, 3, 4))  # type: ignore[arg-type]
    budget = sizes[-1] + sizes[-2]  # the two largest fit together, never three adapters
    manager = make_manager(max_loras=None, lora_page_rank=2, lora_memory=budget, max_cpu_loras=4, **extra)
    _add(manager, adapters, 1, 2, 3, 4)
    rng = random.Random(5)
    running: dict[str, int] = {}
    removed = False
    for step in range(200):
        if running and (len(running) >= 3 or rng.random() < 0.5):
            manager.release(running.pop(rng.choice(sorted(running))))
        elif step == 120 and not removed:
            manager.remove_lora(4)  # drains if pinned
            removed = True
        else:
            adapter_id = rng.choice([1, 2, 3] if removed else [1, 2, 3, 4])
            if manager.can_acquire(adapter_id):
                manager.acquire(adapter_id, f"r{step}")
                running[f"r{step}"] = adapter_id
            else:  # blocked: let everything running finish (the engine's drain rule, shortened)
                for req in running:
                    manager.release(req)
                running.clear()
        manager.check_integrity()
        assert manager.device_nbytes <= budget
        for adapter_id in {a for a in running.values() if manager.is_resident(a)}:
            got = _paged_rows(manager, adapter_id)
            for where, rows in want[adapter_id].items():
                assert torch.equal(got[where], rows), (step, adapter_id, where)
    assert manager.stats().num_evictions > 0
    for req in running:
        manager.release(req)
    manager.check_integrity()


def test_an_adapter_larger_than_lora_memory_is_refused_at_registration(
    adapters: dict[int, Path], make_manager: Any
) -> None:
    """Its pages alone would never fit: a clear validation error now, not a request that waits forever."""
    probe = make_manager(max_loras=None, lora_page_rank=4)
    one_page_each = sum(probe._pool.page_nbytes(g) for g in GROUPS)
    manager = make_manager(max_loras=None, lora_page_rank=4, lora_memory=one_page_each)
    _add(manager, adapters, 1)  # rank 3: one page per group, fits exactly
    with pytest.raises(AdapterValidationError, match=r"exceeds_lora_memory.*raise lora_memory"):
        _add(manager, adapters, 3)  # rank 5: two pages per group
    assert [a.adapter_id for a in manager.list_adapters()] == [1]
    manager.check_integrity()


def test_remove_while_in_use_drains_on_old_weights(adapters: dict[int, Path], make_manager: Any) -> None:
    manager = make_manager(max_loras=2)
    _add(manager, adapters, 1, 2)
    slot_idx = manager.acquire(1, "old1")
    manager.acquire(1, "old2")
    old_weights = _slot_a(manager, slot_idx)

    info = manager.remove_lora(1)
    assert info.num_pins == 2 and info.slot_idx == slot_idx
    with pytest.raises(AdapterRemovedError, match="was removed"):
        manager.acquire(1, "new")
    with pytest.raises(AdapterRemovedError):
        manager.can_acquire(1)
    assert manager.acquire(1, "old1") == slot_idx  # running requests keep their slot
    assert [a.adapter_id for a in manager.list_adapters()] == [2]
    manager.check_integrity()

    # The draining slot is not reused, even when another adapter needs room.
    manager.acquire(2, "b")
    assert manager.slot_of(2) != slot_idx
    assert torch.equal(_slot_a(manager, slot_idx), old_weights)

    manager.release("old1")
    assert manager.get_buffers(0, "qkv").scales[slot_idx] == 1.0
    manager.release("old2")
    assert manager.get_buffers(0, "qkv").scales[slot_idx] == 0.0
    with pytest.raises(AdapterNotFoundError, match="no adapter with id 1"):
        manager.acquire(1, "new")
    manager.release("b")
    manager.check_integrity()


def test_readd_same_id_while_old_version_drains(adapters: dict[int, Path], make_manager: Any) -> None:
    manager = make_manager(max_loras=2)
    _add(manager, adapters, 1)
    old_slot = manager.acquire(1, "old")
    manager.remove_lora(1)
    info = manager.add_lora(LoRARequest("a1", 1, str(adapters[2])))  # new weights, same id and name
    new_slot = manager.acquire(1, "new")
    assert new_slot != old_slot
    assert manager.acquire(1, "old") == old_slot
    assert not torch.equal(_slot_a(manager, old_slot), _slot_a(manager, new_slot))
    assert manager.get_adapter(1).version == info.version
    manager.release("old")
    manager.release("new")
    manager.check_integrity()


def test_host_lru_and_disk_tier(adapters: dict[int, Path], make_manager: Any) -> None:
    manager = make_manager(max_loras=1, max_cpu_loras=2)
    _add(manager, adapters, 1, 2, 3)  # adapter 1 falls out of the host cache
    assert [a.tier for a in manager.list_adapters()] == ["disk", "host", "host"]
    assert not manager.can_acquire(1)
    assert not manager.prefetch(1)
    deadline = time.monotonic() + 30
    while not manager.prefetch(1):
        assert time.monotonic() < deadline, "background load did not finish"
        time.sleep(0.01)
    assert manager.can_acquire(1)
    assert [a.tier for a in manager.list_adapters()] == ["host", "disk", "host"]
    # A host miss in acquire reads from disk synchronously.
    assert manager.acquire(2, "r") == 0
    assert manager.get_adapter(2).tier == "device"
    manager.release("r")
    manager.check_integrity()


def test_slow_disk_read_does_not_block_other_adapters(
    adapters: dict[int, Path], make_manager: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = make_manager(max_loras=2, max_cpu_loras=1)
    _add(manager, adapters, 1, 2)  # adapter 1 only on disk now
    gate = threading.Event()
    real_load = manager._store.load

    def slow_load(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(30)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(manager._store, "load", slow_load)
    assert not manager.prefetch(1)
    start = time.monotonic()
    assert manager.acquire(2, "fast") == 0  # served while adapter 1 is still loading
    manager.release("fast")
    assert time.monotonic() - start < 5
    assert not manager.can_acquire(1)
    gate.set()
    deadline = time.monotonic() + 30
    while not manager.prefetch(1):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert manager.acquire(1, "slow") == 1
    manager.release("slow")
    manager.check_integrity()


def test_files_changed_on_disk_are_detected(
    adapters: dict[int, Path], tmp_path: Path, make_manager: Any
) -> None:
    src = tmp_path / "inplace"
    shutil.copytree(adapters[1], src)
    manager = make_manager(max_cpu_loras=1, copy_directories=False)
    manager.add_lora(LoRARequest("a", 1, str(src)))
    assert manager.get_adapter(1).folder == src
    _add(manager, adapters, 2)  # pushes adapter 1 out of host memory

    def bump(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key(0, "q_proj")] += 1

    edit_tensors(src, bump)
    with pytest.raises(AdapterValidationError) as info:
        manager.acquire(1, "r")
    assert info.value.reason == "changed_on_disk"
    manager.check_integrity()


def test_identity_and_content_addressed_store(
    adapters: dict[int, Path], tmp_path: Path, store_dir: Path, make_manager: Any
) -> None:
    manager = make_manager()
    a = manager.add_lora(LoRARequest("french", 1, str(adapters[1])), owner="acme")
    assert (a.name, a.owner, a.adapter_id, len(a.version)) == ("french", "acme", 1, 64)
    assert a.identity.cache_key == (1, a.version)

    # Reformatting the JSON does not change the version; other weights do.
    pretty = tmp_path / "pretty"
    shutil.copytree(adapters[1], pretty)
    config = json.loads((pretty / CONFIG).read_text())
    (pretty / CONFIG).write_text(json.dumps(config, indent=7, sort_keys=False))
    b = manager.add_lora(LoRARequest("french-copy", 2, str(pretty)), owner="acme")
    assert b.version == a.version and b.folder == a.folder
    assert manager.get_adapter(2).version != manager.add_lora(LoRARequest("x", 3, str(adapters[2]))).version
    assert sorted(p.name for p in store_dir.iterdir()) == sorted({a.version, manager.get_adapter(3).version})

    # Idempotent re-add; conflicting id or (owner, name) is refused.
    assert manager.add_lora(LoRARequest("french", 1, str(adapters[1])), owner="acme") == manager.get_adapter(
        1
    )
    with pytest.raises(AdapterExistsError, match="id 1"):
        manager.add_lora(LoRARequest("french", 1, str(adapters[2])), owner="acme")
    with pytest.raises(AdapterExistsError, match="named 'french'"):
        manager.add_lora(LoRARequest("french", 9, str(adapters[2])), owner="acme")
    manager.add_lora(LoRARequest("french", 9, str(adapters[2])), owner="other")  # other tenant: fine
    assert manager.find_adapter("french", "other").adapter_id == 9  # type: ignore[union-attr]
    assert manager.find_adapter("french") is None
    manager.check_integrity()

    # The shared folder survives until its last user is removed.
    manager.remove_lora(1)
    assert a.folder.exists()
    manager.remove_lora(2)
    assert not a.folder.exists()
    with pytest.raises(AdapterNotFoundError):
        manager.remove_lora(2)
    manager.check_integrity()


def test_close_removes_a_temporary_store(adapters: dict[int, Path], spec: Any) -> None:
    from loraplex.adapters import AdapterManagerConfig

    with AdapterManager(spec, AdapterManagerConfig(max_lora_rank=8)) as manager:
        info = manager.add_lora(LoRARequest("a", 1, str(adapters[1])))
        root = info.folder.parent
        assert files_under(root)
    assert not root.exists()


def test_request_and_config_validation() -> None:
    from loraplex.adapters import AdapterManagerConfig

    req = LoRARequest("n", 3, "/x")
    assert (req.lora_name, req.lora_int_id, req.lora_path, req.adapter_id) == ("n", 3, "/x", 3)
    for bad in (dict(name="", int_id=1, path="p"), dict(name="n", int_id=0, path="p")):
        with pytest.raises(ValueError):
            LoRARequest(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_loras"):
        AdapterManagerConfig(max_loras=0)


def test_spec_from_hf_configs() -> None:
    from transformers import MistralConfig, Qwen2Config

    from loraplex.adapters import BaseModelSpec

    qwen = BaseModelSpec.from_hf_config(
        Qwen2Config(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2)
    )
    assert (qwen.q_proj, qwen.k_proj, qwen.o_proj, qwen.down_proj) == ((64, 64), (64, 16), (64, 64), (96, 64))
    mistral = BaseModelSpec.from_hf_config(
        MistralConfig(
            hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1, head_dim=32
        )
    )
    assert (mistral.q_proj, mistral.v_proj, mistral.o_proj) == ((64, 128), (64, 32), (128, 64))
    assert mistral.slice_sizes("qkv") == (128, 32, 32)
    assert mistral.group_in_features("down") == 96


def test_weights_untouched_by_add_failure_after_staging(
    adapters: dict[int, Path], store_dir: Path, make_manager: Any
) -> None:
    manager = make_manager()
    _add(manager, adapters, 1)
    with pytest.raises(AdapterExistsError):
        manager.add_lora(LoRARequest("other", 1, str(adapters[2])))
    assert [p.name for p in store_dir.iterdir()] == [manager.get_adapter(1).version]
    assert sorted(p.name for p in (store_dir / manager.get_adapter(1).version).iterdir()) == [CONFIG, WEIGHTS]
    manager.check_integrity()
