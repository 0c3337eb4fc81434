"""The engine's one pool for KV blocks and adapter pages, KV first, through whole requests.

- an idle adapter's blocks go back to the KV cache before a sequence would be preempted or
  refused, and its tokens are the same when it is paged in again;
- a request whose adapter and KV cannot fit the pool together ends with a clear error instead
  of waiting for ever, and its neighbours are served;
- with no adapter resident, the KV cache has every block.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
from support.adapters import make_peft_adapter
from support.engines import make_engine

from loraplex import LoRARequest, SamplingParams
from loraplex.adapters.page_table import pages_needed
from loraplex.platform.engine.engine import LLMEngine

BLOCK = 8
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def big_adapter(tiny_dirs: dict[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> LoRARequest:
    root = tmp_path_factory.mktemp("pool-policy")
    spec = dict(r=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
    make_peft_adapter(tiny_dirs["gqa_tied"], root / "big", seed=5, spec=spec)  # type: ignore[index]
    return LoRARequest("big", 1, str(root / "big"))


_engine = partial(
    make_engine,
    block_size=BLOCK,
    max_num_seqs=8,
    max_num_batched_tokens=512,
    enable_lora=True,
    enable_prefix_caching=False,
)


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], LoRARequest | None]]) -> dict[str, Any]:
    for rid, prompt, lora in requests:
        engine.add_request(rid, prompt, GREEDY, lora_request=lora)
    outs: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        engine.check_integrity()
        steps += 1
        assert steps < 500, "no progress"
    return outs


def _blocks_alone(model: Path, lora: LoRARequest) -> int:
    """Pool blocks the adapter's pages take on their own (measured on a roomy engine)."""
    probe = _engine(model, num_kv_blocks=512)
    try:
        return _adapter_blocks(probe, lora)
    finally:
        probe.shutdown()


def _adapter_blocks(engine: LLMEngine, lora: LoRARequest) -> int:
    runtime = engine.lora_runtime
    assert runtime is not None
    runtime.add_lora(lora)
    manager = runtime.adapter_manager
    entry = manager._registry.require(lora.int_id)
    weights = manager._host_weights(entry)
    return manager._pool.blocks_for(pages_needed(weights, manager.page_rank))


@pytest.mark.slow
def test_an_idle_adapter_yields_its_blocks_before_a_sequence_is_preempted(
    tiny_dirs: dict[str, Path], big_adapter: LoRARequest
) -> None:
    need = _blocks_alone(tiny_dirs["gqa_tied"], big_adapter)
    pool = need + 40
    engine = _engine(tiny_dirs["gqa_tied"], num_kv_blocks=pool)
    first = _run(engine, [("with-adapter", list(range(5, 21)), big_adapter)])
    counts = engine.kv.block_counts()
    assert counts.num_adapter_device_blocks >= need and counts.num_used_device_blocks == 0
    # Base requests wanting more KV than the free blocks: the idle adapter goes, nobody is
    # preempted (6 x 9 blocks of 8 tokens > the 40 blocks beside the adapter).
    prompts = [[100 + 7 * i + j for j in range(66)] for i in range(6)]
    base = _run(engine, [(f"base-{i}", p, None) for i, p in enumerate(prompts)])
    assert all(o.error is None for o in base.values())
    assert engine.scheduler.num_preemptions == 0
    stats = engine.stats
    assert stats.adapters is not None and stats.adapters.num_evictions >= 1
    assert engine.kv.block_counts().num_adapter_device_blocks < need
    # Paged in again: the same tokens.
    again = _run(engine, [("with-adapter-again", list(range(5, 21)), big_adapter)])
    assert again["with-adapter-again"].outputs[0].token_ids == first["with-adapter"].outputs[0].token_ids
    engine.shutdown()


@pytest.mark.slow
def test_an_adapter_that_never_fits_beside_its_kv_is_refused_clearly(
    tiny_dirs: dict[str, Path], big_adapter: LoRARequest
) -> None:
    need = _blocks_alone(tiny_dirs["gqa_tied"], big_adapter)
    engine = _engine(tiny_dirs["gqa_tied"], num_kv_blocks=need + 4)
    # 8 blocks of KV: fits the pool alone, never beside the adapter.
    outs = _run(
        engine,
        [("too-big", list(range(5, 5 + 8 * BLOCK - 2)), big_adapter), ("neighbour", [5, 6, 7], None)],
    )
    error = outs["too-big"].error
    assert error is not None and "do not fit the device pool together" in str(error)
    assert outs["neighbour"].error is None and len(outs["neighbour"].outputs[0].token_ids) == 6
    # The adapter never took a block: with none resident, the KV cache has every block.
    assert engine.kv.block_counts().num_adapter_device_blocks == 0
    assert engine.kv.block_manager.num_free_blocks == need + 4
    engine.shutdown()
