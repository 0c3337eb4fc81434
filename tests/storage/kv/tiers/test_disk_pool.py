"""Disk KV tier on real files: round trips, LRU, the cap, every fault a counted miss, warm restart."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loraplex.storage.kv.kv_cache import KVBlockLayout
from loraplex.storage.kv.sliced import run_to_end
from loraplex.storage.kv.tiers import block_codec
from loraplex.storage.kv.tiers.disk_files import DiskPathError, DiskPathInUseError
from loraplex.storage.kv.tiers.disk_pool import DiskKVPool

LAYOUT = KVBlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
RECORD = block_codec.record_bytes(LAYOUT)
FP = b"model-A/layout-1"


def key(i: int) -> bytes:
    return bytes([i]) * 32


def block(i: int, layout: KVBlockLayout = LAYOUT) -> torch.Tensor:
    numel = layout.bytes_per_block // torch.empty((), dtype=layout.dtype).element_size()
    return (
        (torch.arange(numel, dtype=torch.float32) + 1000.0 * i).to(layout.dtype).reshape(layout.block_shape)
    )


def fetch(pool: DiskKVPool, k: bytes) -> torch.Tensor | None:
    return pool.fetch(k).result(timeout=30)


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[DiskKVPool]:
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, 3 * RECORD, num_workers=2) as p:
        yield p


def fill(pool: DiskKVPool, ids: list[int]) -> None:
    for i in ids:
        assert pool.demote_async(key(i), block(i))
    assert pool.flush(timeout_s=30)


def test_round_trip_files_and_metrics(pool: DiskKVPool) -> None:
    assert pool.num_slots == 3
    files = sorted(p.name for p in pool.path.glob("slot_*.kvb"))
    assert files == ["slot_000000.kvb", "slot_000001.kvb", "slot_000002.kvb"]  # preallocated
    assert all((pool.path / f).stat().st_size == RECORD for f in files)
    fill(pool, [0, 1, 2])
    assert [pool.slot_of(key(i)) for i in range(3)] == [0, 1, 2]
    for i in range(3):
        got = fetch(pool, key(i))
        assert got is not None and torch.equal(got, block(i))
    assert fetch(pool, key(9)) is None
    m = pool.metrics()
    assert (m.capacity_blocks, m.used_blocks, m.hits, m.misses, m.demotions) == (3, 3, 3, 1, 3)
    assert m.bytes_in == m.bytes_out == 3 * LAYOUT.bytes_per_block
    assert m.io_errors == m.checksum_failures == m.invalid_records == 0
    pool.check_integrity()


def test_lru_eviction_reuses_the_oldest_slot(pool: DiskKVPool) -> None:
    fill(pool, [0, 1, 2])
    assert fetch(pool, key(0)) is not None  # 0 is now the most recently used
    fill(pool, [3])
    assert not pool.contains(key(1))
    assert pool.slot_of(key(3)) == 1
    assert pool.held_keys() == [key(2), key(0), key(3)]
    got = fetch(pool, key(3))
    assert got is not None and torch.equal(got, block(3))
    assert pool.metrics().evictions == 1
    pool.check_integrity()


def test_writes_in_flight_are_served_from_memory_and_not_evicted(tmp_path: Path) -> None:
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, RECORD, num_workers=1) as p:
        gate = threading.Event()
        assert p._io.executor is not None
        p._io.executor.submit(gate.wait, 30)  # the only worker waits: writes stay in flight
        assert p.demote_async(key(0), block(0))
        assert p.contains(key(0)) and not p.is_published(key(0))
        got = fetch(p, key(0))  # served from the in-flight copy
        assert got is not None and torch.equal(got, block(0))
        # The one slot is being written: it cannot be evicted, so a new block is a drop.
        assert not p.demote_async(key(1), block(1))
        assert p.metrics().drops == 1
        p.check_integrity()
        gate.set()
        assert p.flush(timeout_s=30)
        assert p.is_published(key(0))
        got = fetch(p, key(0))  # now from the file
        assert got is not None and torch.equal(got, block(0))
        p.check_integrity()


def test_removed_while_in_flight_is_never_published(tmp_path: Path) -> None:
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, 2 * RECORD, num_workers=1) as p:
        gate = threading.Event()
        assert p._io.executor is not None
        p._io.executor.submit(gate.wait, 30)
        assert p.demote_async(key(0), block(0))
        assert p.remove(key(0))
        assert not p.contains(key(0))
        p.check_integrity()  # slot 0 waits in limbo until its write ends
        assert p.demote_async(key(1), block(1))
        assert p.slot_of(key(1)) == 1
        gate.set()
        assert p.flush(timeout_s=30)
        assert not p.contains(key(0)) and fetch(p, key(0)) is None
        assert p.held_keys() == [key(1)]
        fill(p, [2])
        assert p.slot_of(key(2)) == 0  # slot 0 came back once its write ended
        p.check_integrity()


def corrupt(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


HEADER_FIELDS = {"magic": 0, "block_size": 12, "seq": 36, "fingerprint": 50, "dtype": 77, "key": 100}


@pytest.mark.parametrize(
    ("fault", "counter"),
    [
        ("payload_bit", "checksum_failures"),
        ("checksum_bit", "checksum_failures"),
        *[(f"header_{name}", None) for name in HEADER_FIELDS],
        ("truncated", "invalid_records"),
        ("zeroed", "invalid_records"),
        ("directory", "io_errors"),
        ("missing", "io_errors"),
    ],
)
def test_fault_is_a_counted_miss_and_the_slot_is_reused(
    pool: DiskKVPool, fault: str, counter: str | None
) -> None:
    fill(pool, [0, 1])
    path = pool.path / "slot_000000.kvb"
    if fault == "payload_bit":
        corrupt(path, block_codec.HEADER_BYTES + 123)
    elif fault == "checksum_bit":
        corrupt(path, RECORD - 1)
    elif fault.startswith("header_"):
        corrupt(path, HEADER_FIELDS[fault.removeprefix("header_")])
    elif fault == "truncated":
        os.truncate(path, RECORD // 2)
    elif fault == "zeroed":
        path.write_bytes(bytes(RECORD))
    elif fault == "directory":
        path.unlink()
        path.mkdir()
    elif fault == "missing":
        path.unlink()
    before = pool.metrics()
    assert fetch(pool, key(0)) is None
    after = pool.metrics()
    assert after.misses == before.misses + 1 and after.hits == before.hits
    faults = ("checksum_failures", "invalid_records", "io_errors")
    bumped = [c for c in faults if getattr(after, c) == getattr(before, c) + 1]
    if counter is None:  # a header bit: a bad magic/layout/key, or the checksum (seq) catches it
        assert bumped in (["checksum_failures"], ["invalid_records"])
    else:
        assert bumped == [counter]
    assert not pool.contains(key(0))  # the bad record is dropped...
    got = fetch(pool, key(1))  # ...the others are untouched
    assert got is not None and torch.equal(got, block(1))
    pool.check_integrity()
    if fault != "directory":  # the free slot 2 first, then the dropped slot 0
        fill(pool, [5, 6])
        assert (pool.slot_of(key(5)), pool.slot_of(key(6))) == (2, 0)
        got = fetch(pool, key(5))
        assert got is not None and torch.equal(got, block(5))
    pool.check_integrity()


def test_write_error_is_counted_and_not_published(pool: DiskKVPool) -> None:
    # /dev/full answers every write with a real ENOSPC from the kernel.
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    path = pool.path / "slot_000000.kvb"
    path.unlink()
    path.symlink_to("/dev/full")
    assert pool.demote_async(key(0), block(0))
    pool.flush()
    assert not pool.contains(key(0)) and fetch(pool, key(0)) is None
    assert pool.metrics().io_errors == 1
    pool.check_integrity()
    fill(pool, [1])  # the next slot works
    got = fetch(pool, key(1))
    assert got is not None and torch.equal(got, block(1))


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.parametrize("preallocate", [False, True])
def test_enospc_on_a_full_filesystem(small_tmpfs: Path, preallocate: bool) -> None:
    big = KVBlockLayout(num_layers=4, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    record = block_codec.record_bytes(big)  # 128 KiB + header: 7 fit in the 1 MiB tmpfs
    with DiskKVPool(small_tmpfs / "kv", big, FP, 12 * record, preallocate=preallocate) as p:
        if preallocate:
            assert p.metrics().io_errors == 1  # preallocation stopped at ENOSPC
        accepted = [p.demote_async(key(i), block(i, big)) for i in range(12)]
        assert all(accepted)
        p.flush()
        m = p.metrics()
        published = [i for i in range(12) if p.contains(key(i))]
        assert 0 < len(published) < 12
        assert m.io_errors >= 12 - len(published)
        for i in published:
            got = fetch(p, key(i))
            assert got is not None and torch.equal(got, block(i, big))
        for i in set(range(12)) - set(published):
            assert fetch(p, key(i)) is None
        p.check_integrity()


def test_size_zero_pool_touches_nothing(tmp_path: Path) -> None:
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, RECORD - 1) as p:
        assert p.num_slots == 0
        assert not p.demote_async(key(0), block(0))
        assert fetch(p, key(0)) is None
        m = p.metrics()
        assert (m.capacity_blocks, m.drops, m.misses) == (0, 1, 1)
        p.check_integrity()
    assert not (tmp_path / "kv").exists()


def test_warm_restart_same_fingerprint_hits(tmp_path: Path) -> None:
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, 3 * RECORD) as p:
        fill(p, [0, 1, 2])
        assert fetch(p, key(0)) is not None
        assert p.demote_async(key(7), block(7), persistent=False)  # a swap block: evicts 1
        p.flush()
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, 3 * RECORD) as p:
        assert (p.restart.restored, p.restart.discarded) == (2, 1)
        assert p.held_keys() == [key(0), key(2)]  # write order (0 was written before 2)
        for i in (0, 2):
            got = fetch(p, key(i))
            assert got is not None and torch.equal(got, block(i))
        assert fetch(p, key(7)) is None
        p.check_integrity()


@pytest.mark.parametrize(
    ("fingerprint", "layout"),
    [
        (b"model-B/layout-1", LAYOUT),
        (FP, KVBlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)),
    ],
)
def test_warm_restart_other_model_or_layout_discards_all(
    tmp_path: Path, fingerprint: bytes, layout: KVBlockLayout
) -> None:
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, 3 * RECORD) as p:
        fill(p, [0, 1, 2])
    capacity = 3 * block_codec.record_bytes(layout)
    with DiskKVPool(tmp_path / "kv", layout, fingerprint, capacity) as p:
        assert (p.restart.restored, p.restart.discarded) == (0, 3)
        assert p.held_keys() == [] and fetch(p, key(0)) is None
        assert p.demote_async(key(4), block(4, layout))  # the slots are reused
        p.flush()
        got = fetch(p, key(4))
        assert got is not None and torch.equal(got, block(4, layout))
        p.check_integrity()


def test_restart_with_a_smaller_cap_stays_under_it(tmp_path: Path) -> None:
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, 4 * RECORD) as p:
        fill(p, [0, 1, 2, 3])
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, 2 * RECORD) as p:
        assert sorted(p.restart.removed_files) == ["slot_000002.kvb", "slot_000003.kvb"]
        assert p.held_keys() == [key(0), key(1)]
        p.check_integrity()  # includes: slot files hold at most the cap


@pytest.mark.slow
def test_torn_record_after_a_crash_is_a_miss(tmp_path: Path) -> None:
    # A child process writes blocks and dies without close(); one record is then torn
    # (new header over an old payload, as a crash mid-write leaves it).
    child = f"""
import os, runpy
here = runpy.run_path({__file__!r})  # this module: its pool, layout and blocks
DiskKVPool, LAYOUT, FP, RECORD, key, block = (
    here[name] for name in ("DiskKVPool", "LAYOUT", "FP", "RECORD", "key", "block")
)
p = DiskKVPool({str(tmp_path / "kv")!r}, LAYOUT, FP, 3 * RECORD)
for i in range(3):
    p.demote_async(key(i), block(i))
p.flush()
os._exit(0)
"""
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120)
    slot1 = tmp_path / "kv" / "slot_000001.kvb"
    data = bytearray(slot1.read_bytes())
    data[block_codec.HEADER_BYTES : block_codec.HEADER_BYTES + 64] = bytes(64)  # half-written payload
    slot1.write_bytes(bytes(data))
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, 3 * RECORD) as p:
        assert p.restart.restored == 3  # the header is intact: the payload is checked on read
        assert fetch(p, key(1)) is None
        assert p.metrics().checksum_failures == 1
        for i in (0, 2):
            got = fetch(p, key(i))
            assert got is not None and torch.equal(got, block(i))
        p.check_integrity()


def test_one_pool_per_path(tmp_path: Path) -> None:
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, RECORD), pytest.raises(DiskPathInUseError):
        DiskKVPool(tmp_path / "kv", LAYOUT, FP, RECORD)
    DiskKVPool(tmp_path / "kv", LAYOUT, FP, RECORD).close()  # released by close()


def test_bfloat16_round_trip(tmp_path: Path) -> None:
    layout = KVBlockLayout(num_layers=3, block_size=2, num_kv_heads=1, head_dim=4, dtype=torch.bfloat16)
    with DiskKVPool(tmp_path / "kv", layout, FP, 2 * block_codec.record_bytes(layout)) as p:
        data = torch.randn(layout.block_shape).to(torch.bfloat16)
        assert p.demote_async(key(0), data)
        p.flush()
        got = fetch(p, key(0))
        assert got is not None and got.dtype == torch.bfloat16 and torch.equal(got, data)


def test_concurrent_demote_fetch_remove_keep_integrity(tmp_path: Path) -> None:
    errors: list[BaseException] = []
    stop = threading.Event()
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, 5 * RECORD, num_workers=3) as p:

        def worker(seed: int) -> None:
            try:
                for n in range(150):
                    i = (seed * 7 + n) % 12
                    p.demote_async(key(i), block(i))
                    got = p.fetch(key((i + 3) % 12)).result(timeout=30)
                    if got is not None:  # a hit is always the right data
                        assert torch.equal(got, block((i + 3) % 12))
                    if n % 5 == 0:
                        p.remove(key((i + 1) % 12))
            except BaseException as exc:
                errors.append(exc)

        def checker() -> None:
            try:
                while not stop.is_set():
                    p.check_integrity(check_files=False)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
        check = threading.Thread(target=checker)
        check.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        check.join()
        p.flush()
        p.check_integrity()
        assert not errors, errors
        m = p.metrics()
        assert m.io_errors == m.checksum_failures == m.invalid_records == 0


def test_unwritable_directory_is_reported_at_start(tmp_path: Path) -> None:
    target = tmp_path / "kv"
    target.mkdir()
    (target / "slot_000000.kvb").mkdir()  # a directory where a slot file belongs
    with DiskKVPool(target, LAYOUT, FP, 2 * RECORD) as p:
        assert p.metrics().io_errors >= 1
        assert p.demote_async(key(0), block(0))  # lands in slot 0 and fails: counted
        p.flush()
        assert not p.contains(key(0))
        fill(p, [1])
        assert p.contains(key(1))
        p.check_integrity()


def test_a_path_that_cannot_be_the_directory_is_a_clear_error(tmp_path: Path) -> None:
    file = tmp_path / "a-file"
    file.write_bytes(b"x")
    with pytest.raises(DiskPathError, match="exists and is not a directory"):
        DiskKVPool(file, LAYOUT, FP, RECORD)
    with pytest.raises(DiskPathError, match="cannot create it: Not a directory"):
        DiskKVPool(file / "kv", LAYOUT, FP, RECORD)
    assert file.read_bytes() == b"x"  # left alone


def test_a_cap_below_one_record_turns_the_tier_off_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"), DiskKVPool(tmp_path / "kv", LAYOUT, FP, RECORD - 1) as p:
        assert p.num_slots == 0 and not p.demote_async(key(0), block(0))
    assert "holds no KV block" in caplog.text and not (tmp_path / "kv").exists()


def test_clear_forgets_and_erases_every_record_for_a_restart(tmp_path: Path) -> None:
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, 4 * RECORD) as p:
        fill(p, [0, 1, 2])
        # A promoted block leaves the index, but its record stays in the file until reused:
        # a plain restart would find it again. clear() must erase it too.
        assert p.remove(key(1), promoted=True)
        assert p.demote_async(key(3), block(3))  # still in flight when clear() starts (or not)
        dropped, erased = p.clear(keep=[key(2)])
        assert dropped == 2  # 0 and 3; 2 is kept
        assert erased == 3  # the files of 0, 1 (promoted) and 3
        assert p.held_keys() == [key(2)] and fetch(p, key(0)) is None and fetch(p, key(3)) is None
        p.check_integrity()
        kept = fetch(p, key(2))
        assert kept is not None and torch.equal(kept, block(2))
        sizes = {f.name: f.stat().st_size for f in p.path.glob("slot_*.kvb")}
        assert set(sizes.values()) == {RECORD}  # erased files are preallocated again: the cap holds
        fill(p, [4])  # erased slots take new records
        got = fetch(p, key(4))
        assert got is not None and torch.equal(got, block(4))
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, 4 * RECORD) as p:
        # Only what was held after the clear comes back; the erased slots read as never written.
        assert (p.restart.restored, p.restart.discarded, p.restart.unreadable) == (2, 0, 0)
        assert sorted(p.held_keys()) == sorted([key(2), key(4)])
        for i in (0, 1, 3):
            assert fetch(p, key(i)) is None
        p.check_integrity()


def test_clear_counts_a_slot_it_cannot_erase(tmp_path: Path) -> None:
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, 2 * RECORD) as p:
        fill(p, [0, 1])
        slot0 = p.path / "slot_000000.kvb"
        slot0.unlink()
        slot0.mkdir()  # something that is not a slot file in its place: erase cannot open it
        dropped, erased = p.clear()
        assert (dropped, erased) == (2, 1)
        assert p.metrics().io_errors == 1 and p.held_keys() == []
        p.check_integrity(check_files=False)


def test_owner_round_trips_and_a_record_without_one_reads_as_nobodys() -> None:
    header = block_codec.encode_header(LAYOUT, FP, key(1), 7, True, owner=b"T" * 32)
    assert block_codec.parse_header(header).owner == b"T" * 32
    assert block_codec.parse_header(block_codec.encode_header(LAYOUT, FP, key(1), 7, True)).owner == b""
    with pytest.raises(ValueError, match="owners are at most 32"):
        block_codec.encode_header(LAYOUT, FP, key(1), 7, True, owner=b"T" * 33)


def test_purge_drops_and_erases_one_owners_records_only(tmp_path: Path) -> None:
    a, b = b"A" * 32, b"B" * 32
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, 5 * RECORD) as p:
        for i, owner in [(0, a), (1, b), (2, a), (3, b"")]:
            assert p.demote_async(key(i), block(i), owner=owner)
        p.flush()
        assert [p.owner_of(key(i)) for i in range(4)] == [a, b, a, b""]
        assert p.remove(key(2), promoted=True)  # its record stays in the (now free) file
        assert p.purge(a) == (1, 2)  # 0 dropped; the files of 0 and 2 erased
        assert sorted(p.held_keys()) == sorted([key(1), key(3)])
        assert fetch(p, key(0)) is None
        for i in (1, 3):
            got = fetch(p, key(i))
            assert got is not None and torch.equal(got, block(i))
        p.check_integrity()
        with pytest.raises(ValueError, match="needs an owner"):
            p.purge(b"")
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, 5 * RECORD) as p:
        assert p.restart.restored == 2 and sorted(p.held_keys()) == sorted([key(1), key(3)])
        assert (p.owner_of(key(1)), p.owner_of(key(3))) == (b, b"")  # owners survive a restart
        assert p.purge(b) == (1, 1)
        assert p.held_keys() == [key(3)]
        p.check_integrity()


def test_a_sliced_purge_lets_writes_in_between_and_never_erases_them(tmp_path: Path) -> None:
    a, b = b"A" * 32, b"B" * 32
    with DiskKVPool(tmp_path / "kv", LAYOUT, FP, 6 * RECORD) as p:
        for i in range(6):
            assert p.demote_async(key(i), block(i), owner=a)
        p.flush()
        steps = p.purge_steps(a)
        while p.held_keys():  # up to the piece that drops the keys
            next(steps)
        next(steps)  # the first free slot's file erased
        # Between pieces, another owner's blocks take two freed slots: the first erased already,
        # the second not yet; the purge must skip it (its new record is not the tenant's).
        for i in (10, 11):
            assert p.demote_async(key(i), block(i), owner=b)
        p.flush()
        assert run_to_end(steps) == (6, 5)
        assert sorted(p.held_keys()) == sorted([key(10), key(11)])
        for i in (10, 11):
            got = fetch(p, key(i))
            assert got is not None and torch.equal(got, block(i))
        p.check_integrity()
