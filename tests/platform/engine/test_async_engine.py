"""AsyncEngine: submissions cancelled mid-way leave nothing behind; shutdown fails open requests."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.errors import EngineDeadError
from loraplex.platform.engine.outputs import RequestOutput
from loraplex.platform.engine.sampling_params import SamplingParams


def _wait_idle(engine: LLMEngine, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, f"engine still busy after {timeout_s} s"
        time.sleep(0.02)


def test_cancelled_submissions_and_shutdown(tiny_dirs: dict[str, Path]) -> None:
    """Cancelling a submission (the client left during it) leaves nothing running; a shut
    down engine refuses new requests and ends open ones with EngineDeadError."""
    config = EngineConfig(model=str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=128)
    engine = LLMEngine(config)
    aeng = AsyncEngine(engine)
    free = engine.kv.block_manager.num_free_blocks
    params = SamplingParams(max_tokens=500, ignore_eos=True)

    async def cancelled_submissions() -> None:
        tasks = []
        for i in range(20):
            task = asyncio.ensure_future(aeng.add_request(f"c{i}", [5, 6, 7], params))
            await asyncio.sleep(0 if i % 2 else 0.001)
            task.cancel()  # a no-op if the engine already accepted it
            tasks.append(task)
        await asyncio.wait(tasks)
        for task in tasks:
            if not task.cancelled():  # accepted before the cancel: the caller aborts it
                task.result().abort()

    asyncio.run(cancelled_submissions())
    _wait_idle(engine, 2)
    assert engine.kv.block_manager.num_free_blocks == free and not engine.requests

    async def open_then_shutdown() -> list[RequestOutput]:
        stream = await aeng.add_request("s", [5, 6, 7], params)
        seen = [await anext(stream)]
        await asyncio.to_thread(aeng.shutdown)
        with pytest.raises(EngineDeadError):
            async for out in stream:
                seen.append(out)
        with pytest.raises(EngineDeadError):
            await aeng.add_request("t", [5, 6, 7], params)
        with pytest.raises(EngineDeadError):
            await aeng.reset_prefix_cache()
        return seen

    assert asyncio.run(open_then_shutdown())


def test_generate_closed_early_aborts(tiny_dirs: dict[str, Path]) -> None:
    config = EngineConfig(model=str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=128)
    engine = LLMEngine(config)
    aeng = AsyncEngine(engine)
    free = engine.kv.block_manager.num_free_blocks

    async def two_outputs_then_leave() -> None:
        gen = aeng.generate([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True))
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await gen.aclose()

    try:
        asyncio.run(two_outputs_then_leave())
        _wait_idle(engine, 2)
        assert engine.kv.block_manager.num_free_blocks == free
        engine.check_integrity()
    finally:
        aeng.shutdown()
