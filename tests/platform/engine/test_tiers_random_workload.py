"""A drawn workload through a small pool with the KV tiers, against the engine without any cache.

Forty requests over four shared prefixes (greedy, and seeded ``n`` = 2 samples), arriving
over the first steps, run through a pool far too small for them: prefix hits, evictions
down the tiers, promotions back, preemption by swap (to host, or to disk with reads in
flight), lost swaps, recompute. Whatever happened, every request must end with the tokens
the cache-off engine with a pool that never preempts gives it, and ``check_integrity()``
must hold after every step (with the device keys: one location per cached block). The same
holds on a disk that fails reads, corrupts records and refuses writes (``FlakyDisk``): faults
cost hits, never tokens; and a copy kept below after a recompute fails the check.
"""

from __future__ import annotations

import errno
import random
import threading
from pathlib import Path

import pytest
from support.engines import WORKLOAD_BLOCK_SIZE, draw_workload, run_workload

from loraplex.platform.engine.engine import LLMEngine

# One block of the tiny gqa model: 2 layers, K and V, 2 KV heads of 16, float32.
BLOCK_BYTES = 2 * 2 * WORKLOAD_BLOCK_SIZE * 2 * 16 * 4


@pytest.mark.slow
@pytest.mark.parametrize("seed", [5, 7])
@pytest.mark.parametrize("tiers", ["swap-to-host", "auto-to-disk", "recompute"])
def test_a_drawn_workload_gives_the_uncached_tokens(
    tiny_dirs: dict[str, Path], tmp_path: Path, seed: int, tiers: str
) -> None:
    model, arrivals = tiny_dirs["gqa_tied"], draw_workload(seed)
    expected, reference = run_workload(model, arrivals, False, enable_prefix_caching=False, num_kv_blocks=400)
    assert reference.scheduler.num_preemptions == 0
    reference.shutdown()
    config: dict[str, object] = {
        "swap-to-host": dict(num_kv_blocks=24, host_kv_cache_bytes=32 * BLOCK_BYTES, preemption_mode="swap"),
        "auto-to-disk": dict(
            num_kv_blocks=24,
            disk_kv_path=str(tmp_path / "kv"),
            disk_kv_cache_bytes=1 << 20,
            preemption_mode="auto",
        ),
        "recompute": dict(num_kv_blocks=20, preemption_mode="recompute"),
    }[tiers]
    got, engine = run_workload(model, arrivals, True, **config)
    sched = engine.scheduler
    assert got == expected
    assert sched.num_preemptions > 0, "the pool must be too small for the workload"
    if tiers != "recompute":
        assert sched.num_swapped_out > 0
        assert sched.num_swapped_in + sched.num_swaps_lost <= sched.num_swapped_out
        tier_metrics = {m.tier: m for m in engine.kv.tiers.metrics()} if engine.kv.tiers else {}
        assert sum(m.promotions for m in tier_metrics.values()) > 0
    engine.shutdown()


class FlakyDisk:
    """Faults injected into the engine's real disk tier files, drawn from a seeded stream:
    15% of reads fail (EIO), 15% more return a record with a flipped bit, 15% of writes
    fail (ENOSPC)."""

    def __init__(self, engine: LLMEngine, seed: int) -> None:
        assert engine.kv.tiers is not None and engine.kv.tiers.disk is not None
        files = engine.kv.tiers.disk._files
        rng, lock = random.Random(seed), threading.Lock()  # the tier's I/O threads draw too
        read_record, write_record = files.read_record, files.write_record

        def draw() -> float:
            with lock:
                return rng.random()

        def read(slot: int) -> bytearray:
            x = draw()
            if x < 0.15:
                raise OSError(errno.EIO, "injected read error")
            data = read_record(slot)
            if x < 0.30:
                data[len(data) // 2] ^= 0x10
            return data

        def write(slot: int, header: bytes, payload: memoryview, fsync: bool) -> None:
            if draw() < 0.15:
                raise OSError(errno.ENOSPC, "injected ENOSPC")
            write_record(slot, header, payload, fsync)

        files.read_record = read  # type: ignore[method-assign]
        files.write_record = write  # type: ignore[method-assign]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto", "swap"])
def test_a_flaky_disk_costs_hits_never_tokens(tiny_dirs: dict[str, Path], tmp_path: Path, mode: str) -> None:
    model, arrivals = tiny_dirs["gqa_tied"], draw_workload(3)
    expected, reference = run_workload(model, arrivals, False, enable_prefix_caching=False, num_kv_blocks=400)
    reference.shutdown()
    got, engine = run_workload(
        model,
        arrivals,
        True,
        lambda e: FlakyDisk(e, seed=1),
        num_kv_blocks=24,
        disk_kv_path=str(tmp_path / "kv"),
        disk_kv_cache_bytes=1 << 20,
        preemption_mode=mode,
    )
    assert got == expected
    assert engine.kv.tiers is not None
    disk = {m.tier: m for m in engine.kv.tiers.metrics()}["disk"]
    assert disk.io_errors > 0 and disk.checksum_failures > 0  # the faults happened and were counted
    assert disk.promotions > 0 and engine.scheduler.num_swaps_lost > 0  # and some blocks still came back
    engine.shutdown()


def test_a_copy_kept_below_after_a_recompute_fails_the_integrity_check(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The flaky-disk workload with the device's ``on_cache`` hook removed, so a block the device
    computes again (after a failed read, a partial promotion, or beside a copy demoted
    meanwhile) keeps its copy on disk: the engine's ``check_integrity``, run after every step,
    must catch the second location. (Wired, the test above passes the same check.)"""
    engines: list[LLMEngine] = []

    def plant(engine: LLMEngine) -> None:
        FlakyDisk(engine, seed=1)
        engine.kv.block_manager.pool.on_cache = None
        engines.append(engine)

    try:
        with pytest.raises(AssertionError, match="device blocks also live below"):
            run_workload(
                tiny_dirs["gqa_tied"],
                draw_workload(3),
                True,
                plant,
                num_kv_blocks=24,
                disk_kv_path=str(tmp_path / "kv"),
                disk_kv_cache_bytes=1 << 20,
                preemption_mode="auto",
            )
    finally:
        for engine in engines:
            engine.shutdown()
