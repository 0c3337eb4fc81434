"""KV tiers in the engine: prefix hits served from host RAM and from disk, warm restart, faults.

The accelerator pool is sized so a prompt's blocks are evicted by the traffic that
follows it; the tiers catch them (demotion) and give them back on the next hit
(promotion). Every test compares greedy tokens with an engine that has no cache.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
from support.engines import tiny_engine

from loraplex import LLM, SamplingParams
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.outputs import RequestOutput

BLOCK = 8
PROMPT = [(11 * i) % 900 + 5 for i in range(81)]  # 10 full blocks + 1 token
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
FILLERS = [[(13 * i + 7 * j) % 900 + 5 for i in range(60)] for j in range(4)]


# Twenty blocks are two prompts' worth: later traffic evicts earlier blocks.
_engine = partial(tiny_engine, block_size=BLOCK, num_kv_blocks=20, max_num_seqs=2)


def _run(engine: LLMEngine, rid: str, prompt: list[int], tenant: str | None = None) -> RequestOutput:
    engine.add_request(rid, prompt, GREEDY, tenant_id=tenant)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None and final.error is None, final
    return final


def _evict_everything(engine: LLMEngine) -> None:
    for j, filler in enumerate(FILLERS):
        _run(engine, f"filler-{j}", filler)


@pytest.fixture(scope="module")
def reference(tiny_dirs: dict[str, Path]) -> list[int]:
    return _run(_engine(tiny_dirs, enable_prefix_caching=False), "ref", PROMPT).outputs[0].token_ids


def _metrics(engine: LLMEngine, tier: str) -> dict[str, int]:
    assert engine.kv.tiers is not None
    for m in engine.kv.tiers.metrics():
        if m.tier == tier:
            return {k: v for k, v in vars(m).items() if isinstance(v, int)}
    raise AssertionError(f"no {tier} tier")


def test_without_tiers_an_evicted_prefix_is_recomputed(
    tiny_dirs: dict[str, Path], reference: list[int]
) -> None:
    engine = _engine(tiny_dirs)
    _run(engine, "warm", PROMPT)
    _evict_everything(engine)
    out = _run(engine, "again", PROMPT)
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference


def test_hits_come_back_from_host(tiny_dirs: dict[str, Path], reference: list[int]) -> None:
    engine = _engine(tiny_dirs, host_kv_cache_bytes=1 << 20)
    _run(engine, "warm", PROMPT)
    _evict_everything(engine)
    out = _run(engine, "again", PROMPT)
    assert out.num_cached_tokens == 10 * BLOCK
    assert out.outputs[0].token_ids == reference
    host = _metrics(engine, "host")
    assert host["promotions"] >= 10 and host["demotions"] >= 10
    engine.check_integrity()


@pytest.mark.slow
def test_hits_come_back_from_disk_and_after_a_restart(
    tiny_dirs: dict[str, Path], reference: list[int], tmp_path: Path
) -> None:
    tiers = dict(disk_kv_path=str(tmp_path / "kv"), disk_kv_cache_bytes=4 << 20)
    engine = _engine(tiny_dirs, **tiers)  # no host tier: evictions go straight to disk
    _run(engine, "warm", PROMPT)
    _evict_everything(engine)
    out = _run(engine, "again", PROMPT)
    assert out.num_cached_tokens == 10 * BLOCK and out.outputs[0].token_ids == reference
    assert _metrics(engine, "disk")["promotions"] >= 10
    engine.check_integrity()
    engine.shutdown()

    restarted = _engine(tiny_dirs, **tiers)
    out = _run(restarted, "after-restart", PROMPT)
    assert out.num_cached_tokens == 10 * BLOCK and out.outputs[0].token_ids == reference
    restarted.shutdown()


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _zero_second_half(path: Path) -> None:
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.seek(size // 2)
        f.write(b"\0" * (size - size // 2))


def _truncate(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 3)


def _make_unreadable(path: Path) -> None:
    # Root ignores file modes: a directory in the file's place cannot be read by anyone.
    path.unlink()
    path.mkdir()


@pytest.mark.slow
@pytest.mark.parametrize("damage", [_flip_middle_byte, _zero_second_half, _truncate, _make_unreadable])
def test_damaged_disk_blocks_are_misses_not_wrong_tokens(
    tiny_dirs: dict[str, Path], reference: list[int], tmp_path: Path, damage: object
) -> None:
    tiers = dict(disk_kv_path=str(tmp_path / "kv"), disk_kv_cache_bytes=4 << 20)
    engine = _engine(tiny_dirs, **tiers)
    _run(engine, "warm", PROMPT)
    engine.shutdown()
    files = sorted(p for p in (tmp_path / "kv").rglob("*") if p.is_file() and p.stat().st_size > 4096)
    assert files, "the disk tier wrote no block files"
    for path in files:
        damage(path)  # type: ignore[operator]

    restarted = _engine(tiny_dirs, **tiers)
    out = _run(restarted, "after-damage", PROMPT)
    assert out.outputs[0].token_ids == reference
    assert out.num_cached_tokens < 10 * BLOCK  # what was damaged was not served
    disk = _metrics(restarted, "disk")
    assert disk["checksum_failures"] + disk["invalid_records"] + disk["io_errors"] + disk["misses"] >= 1
    restarted.check_integrity()
    restarted.shutdown()


def test_a_host_pool_of_size_zero_only_drops(tiny_dirs: dict[str, Path], reference: list[int]) -> None:
    engine = _engine(tiny_dirs, host_kv_cache_bytes=1)  # smaller than one block: no slot at all
    _run(engine, "warm", PROMPT)
    _evict_everything(engine)
    out = _run(engine, "again", PROMPT)
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference
    assert engine.kv.tiers is not None and engine.kv.tiers.num_dropped_blocks >= 10
    engine.check_integrity()


def test_preempted_sequences_come_back_from_the_host_tier(tiny_dirs: dict[str, Path]) -> None:
    """Two long generations in a pool that holds one: the newer is preempted; its full blocks
    stay cached, are demoted to host when the pool reuses them, and are promoted back when it
    resumes, so only its partial last block is recomputed. Tokens equal the run without cache."""
    long = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    prompts = [PROMPT[:40], PROMPT[40:80]]

    def run(**kw: object) -> tuple[list[list[int]], LLMEngine]:
        llm = LLM(
            model=str(tiny_dirs["gqa_tied"]),
            dtype="float32",
            block_size=BLOCK,
            num_kv_blocks=16,
            **kw,  # type: ignore[arg-type]
        )
        outs = llm.generate(prompts, long, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.llm_engine

    expected, _ = run(enable_prefix_caching=False)
    got, engine = run(host_kv_cache_bytes=1 << 20)
    assert got == expected
    assert engine.scheduler.num_preemptions > 0
    assert _metrics(engine, "host")["promotions"] > 0
    engine.check_integrity()


def test_tier_settings_that_cannot_mean_what_they_say_are_refused() -> None:
    from loraplex.platform.engine.config import EngineConfig

    # A disk path without a cap would silently serve with no disk tier at all.
    with pytest.raises(ValueError, match="needs disk_kv_cache_bytes"):
        EngineConfig(disk_kv_path="/tmp/kv")
    with pytest.raises(ValueError, match="needs disk_kv_path"):
        EngineConfig(disk_kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="need enable_prefix_caching=True"):
        EngineConfig(enable_prefix_caching=False, host_kv_cache_bytes=1 << 20)


@pytest.mark.slow
def test_reset_prefix_cache_forgets_every_tier_and_survives_no_restart(
    tiny_dirs: dict[str, Path], reference: list[int], tmp_path: Path
) -> None:
    """vLLM's ``reset_prefix_cache``: refused while a request is unfinished; when idle, the
    prompt's blocks on the device, in host RAM and on disk are all gone, also for a restart."""
    probe = _engine(tiny_dirs, host_kv_cache_bytes=1 << 20)
    assert probe.kv.tiers is not None
    host_bytes = 3 * probe.kv.tiers.layout.bytes_per_block  # 3 host slots: the rest goes to disk
    tiers = dict(
        host_kv_cache_bytes=host_bytes, disk_kv_path=str(tmp_path / "kv"), disk_kv_cache_bytes=4 << 20
    )
    engine = _engine(tiny_dirs, **tiers)
    _run(engine, "warm", PROMPT)
    _evict_everything(engine)  # PROMPT's blocks: on disk and host now
    _run(engine, "device", FILLERS[0])  # and a prompt cached on the device
    assert _metrics(engine, "host")["used_blocks"] > 0 and _metrics(engine, "disk")["used_blocks"] > 0
    assert engine.kv.block_manager.pool.num_cached_blocks > 0

    engine.add_request("busy", PROMPT, GREEDY)
    assert engine.reset_prefix_cache() is False  # unfinished: nothing changes
    assert engine.kv.block_manager.pool.num_cached_blocks > 0
    while engine.has_unfinished_requests():
        engine.step()

    assert engine.reset_prefix_cache() is True
    assert engine.kv.block_manager.pool.num_cached_blocks == 0
    assert _metrics(engine, "host")["used_blocks"] == _metrics(engine, "disk")["used_blocks"] == 0
    engine.check_integrity()
    out = _run(engine, "again", PROMPT)
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference
    assert _run(engine, "again-device", FILLERS[0]).num_cached_tokens == 0
    assert engine.reset_prefix_cache() is True
    engine.shutdown()  # writes what the device still caches (nothing) to disk

    restarted = _engine(tiny_dirs, **tiers)
    assert restarted.kv.tiers is not None and restarted.kv.tiers.disk is not None
    assert restarted.kv.tiers.disk.restart.restored == 0
    out = _run(restarted, "after-restart", PROMPT)
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference
    restarted.shutdown()


@pytest.mark.slow
def test_purge_tenant_erases_its_blocks_on_every_tier_and_keeps_the_others(
    tiny_dirs: dict[str, Path], reference: list[int], tmp_path: Path
) -> None:
    """A deleted tenant's cached KV leaves the device, host RAM and disk (also for a restart),
    while another tenant's copy of the same prompt keeps hitting; purged while busy."""
    probe = _engine(tiny_dirs, host_kv_cache_bytes=1 << 20)
    assert probe.kv.tiers is not None
    tiers = dict(
        host_kv_cache_bytes=12 * probe.kv.tiers.layout.bytes_per_block,
        disk_kv_path=str(tmp_path / "kv"),
        disk_kv_cache_bytes=4 << 20,
    )
    engine = _engine(tiny_dirs, **tiers)
    _run(engine, "gone-warm", PROMPT, "acme")
    _run(engine, "kept-warm", PROMPT, "globex")
    _evict_everything(engine)  # both copies now below the device, on host and disk
    _run(engine, "gone-device", FILLERS[0], "acme")  # one cached on the device too
    engine.add_request("busy", FILLERS[1], GREEDY)  # the purge does not wait for idle

    device, host, disk = engine.purge_tenant("acme")
    assert device == 7 and host + disk == 10  # FILLERS[0]'s 7 full blocks, PROMPT's 10
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    again = _run(engine, "gone-again", PROMPT, "acme")
    kept = _run(engine, "kept-again", PROMPT, "globex")
    assert (again.num_cached_tokens, kept.num_cached_tokens) == (0, 10 * BLOCK)
    assert again.outputs[0].token_ids == kept.outputs[0].token_ids == reference
    assert _run(engine, "gone-device-again", FILLERS[0], "acme").num_cached_tokens == 0
    engine.check_integrity()
    engine.shutdown()  # writes what the device caches to disk: nothing of acme's (never cached again)

    restarted = _engine(tiny_dirs, **tiers)
    assert _run(restarted, "gone-restart", PROMPT, "acme").num_cached_tokens == 0
    assert _run(restarted, "kept-restart", PROMPT, "globex").num_cached_tokens == 10 * BLOCK
    restarted.shutdown()


@pytest.mark.slow
def test_a_sliced_reset_and_purge_interleave_with_steps_and_keep_every_invariant(
    tiny_dirs: dict[str, Path], reference: list[int], tmp_path: Path
) -> None:
    """Resets and purges run as jobs between steps (``run_maintenance``): requests that come
    meanwhile (hitting, missing, promoting from disk) run correctly, the integrity checks hold
    after every slice, and when the reset ends no block cached before it is found."""
    engine = _engine(tiny_dirs, disk_kv_path=str(tmp_path / "kv"), disk_kv_cache_bytes=4 << 20)
    _run(engine, "warm", PROMPT, "acme")
    _evict_everything(engine)  # PROMPT's blocks now on disk
    job = engine.start_reset_prefix_cache()
    assert job is not None
    engine.add_request("during", PROMPT, GREEDY, tenant_id="acme")
    finals: dict[str, RequestOutput] = {}
    slices = 0
    while engine.maintenance or engine.has_unfinished_requests():
        engine.run_maintenance(0.0)  # one piece at a time: the most interleaving
        slices += 1
        engine.check_integrity()
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.check_integrity()
    assert job.done and slices > 1
    assert finals["during"].error is None and finals["during"].outputs[0].token_ids == reference
    # A purge in slices while the same tenant's twin and another tenant run.
    _run(engine, "again", PROMPT, "acme")
    _evict_everything(engine)
    purge = engine.start_purge_tenant("acme")
    engine.add_request("other", PROMPT, GREEDY, tenant_id="globex")
    while engine.maintenance or engine.has_unfinished_requests():
        engine.run_maintenance(0.0)
        engine.check_integrity()
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert purge.done and purge.result is not None and sum(purge.result) >= 10
    assert finals["other"].outputs[0].token_ids == reference
    assert _run(engine, "after", PROMPT, "acme").num_cached_tokens == 0
    engine.check_integrity()
    engine.shutdown()
