"""``EngineStats``: one frozen snapshot per step, published by a reference swap.

Counted against what the requests themselves report (tokens per tenant, cached tokens, the
KV blocks in use), read from another thread while the engine runs (every snapshot is
consistent, and a snapshot never changes after it was published), and refreshed after a
command that changes the cache while the engine is idle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from functools import partial
from pathlib import Path

import pytest
from support.engines import tiny_engine

from loraplex import SamplingParams
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.outputs import RequestOutput
from loraplex.platform.engine.stats import EngineStats

BLOCK = 8
PREFIX = [(7 * i) % 500 + 3 for i in range(4 * BLOCK)]


_engine = partial(
    tiny_engine, block_size=BLOCK, num_kv_blocks=40, max_num_seqs=8, host_kv_cache_bytes=1 << 20
)


def _drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_stats_count_what_the_requests_report(tiny_dirs: dict[str, Path]) -> None:
    engine = _engine(tiny_dirs)
    assert engine.stats.step == 0 and engine.stats.num_unfinished == 0
    tenants = {"a0": "acme", "a1": "acme", "g0": "globex", "x0": None}
    for i, (rid, tenant) in enumerate(tenants.items()):
        params = SamplingParams(temperature=0, max_tokens=3 + i, n=2 if rid == "a1" else 1, ignore_eos=True)
        engine.add_request(rid, [*PREFIX, 10 + i, 11, 12], params, tenant_id=tenant)
    first = engine.stats
    assert first.step == 0  # added, not stepped: the snapshot is the last step's
    engine.step()
    # Sequences, not requests: a1's prompt completed in this step and forked its second sample.
    assert engine.stats.step == 1 and engine.stats.num_running + engine.stats.num_waiting == 5
    finals = _drain(engine)
    stats = engine.stats
    assert stats.step == engine.num_steps and stats.num_unfinished == 0
    assert stats.num_batched_tokens == engine.num_batched_tokens
    for name in ("acme", "globex", None):
        mine = [finals[rid] for rid, t in tenants.items() if t == name]
        usage = stats.tenants[name or ""]
        assert usage.num_requests == usage.num_finished == len(mine)
        assert usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in mine)
        assert usage.generated_tokens == sum(len(c.token_ids) for o in mine for c in o.outputs)
        assert usage.cached_tokens == sum(o.num_cached_tokens for o in mine)
        assert usage.num_failed == 0
    # Nothing runs: every device block is free (cached ones count as free), some stay cached.
    assert stats.kv.num_used_device_blocks == 0 and stats.kv.num_device_blocks == 40
    assert stats.kv.num_cached_device_blocks == stats.prefix_cache.num_cached_blocks > 0
    assert stats.prefix_cache.num_queries == 4
    assert [t.tier for t in stats.tiers] == ["host", "disk"] and stats.adapters is None
    # The first snapshot is untouched by everything since, and cannot be edited.
    assert first.step == 0 and dict(first.tenants) == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.step = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        stats.tenants["acme"] = stats.tenants["globex"]  # type: ignore[index]


@pytest.mark.slow
def test_readers_on_another_thread_see_whole_steps(tiny_dirs: dict[str, Path]) -> None:
    engine = _engine(tiny_dirs)
    aeng = AsyncEngine(engine)
    seen: list[EngineStats] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            stats = aeng.stats
            if not seen or seen[-1] is not stats:
                seen.append(stats)

    reader = threading.Thread(target=read)
    reader.start()

    async def traffic() -> list[RequestOutput]:
        async def one(i: int) -> RequestOutput:
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            last = None
            async for out in aeng.generate([*PREFIX, 20 + i], params, tenant_id=f"t{i % 3}"):
                last = out
            assert last is not None
            return last

        return await asyncio.gather(*(one(i) for i in range(12)))

    try:
        outputs = asyncio.run(traffic())
    finally:
        stop.set()
        reader.join()
    try:
        steps = [s.step for s in seen]
        assert steps == sorted(steps) and len(seen) > 3
        for s in seen:
            kv = s.kv
            assert 0 <= kv.num_used_device_blocks <= kv.num_device_blocks
            assert s.num_running <= 8
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        final = aeng.stats
        assert sum(u.generated_tokens for u in final.tenants.values()) == generated
        # Commands refresh the snapshot while the engine is idle: a reset empties the cache now.
        assert final.kv.num_cached_device_blocks > 0
        assert asyncio.run(aeng.reset_prefix_cache())
        assert aeng.stats.kv.num_cached_device_blocks == 0
        assert aeng.stats.step == final.step
    finally:
        aeng.shutdown()
