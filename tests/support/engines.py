"""Engines for the tests, and a drawn workload to run through one.

make_engine(model, **overrides)     an ``LLMEngine`` in float32 on a model directory (None: the
                                    bundled SmolLM2); ``overrides`` are ``EngineConfig`` fields
tiny_engine(tiny_dirs, **overrides) the same on the tiny GQA model (``tiny_dirs["gqa_tied"]``)

A test file with settings of its own names them once, keeping the call sites short::

    _engine = partial(tiny_engine, block_size=BLOCK, num_kv_blocks=20)
    engine = _engine(tiny_dirs, host_kv_cache_bytes=1 << 20)   # later keywords win

draw_workload(seed) / run_workload(model, arrivals, ...)   forty drawn requests over four shared
                                    prefixes, run to the end through an engine (the KV tier tests)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex import SamplingParams
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine


def make_engine(model: Path | str | None, **overrides: Any) -> LLMEngine:
    """An engine in float32 on ``model``; any ``EngineConfig`` field as a keyword."""
    values: dict[str, Any] = {"model": None if model is None else str(model), "dtype": "float32"}
    return LLMEngine(EngineConfig(**{**values, **overrides}))


def tiny_engine(tiny_dirs: Mapping[str, Path], **overrides: Any) -> LLMEngine:
    """``make_engine`` on the session's tiny GQA model (tied embeddings, 2 layers, 2 KV heads of 16)."""
    return make_engine(tiny_dirs["gqa_tied"], **overrides)


WORKLOAD_BLOCK_SIZE = 8


@dataclass(frozen=True)
class Arrival:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    step: int  # added once the engine has run this many steps


def draw_workload(seed: int) -> list[Arrival]:
    """Forty requests over four shared prefixes (greedy, and seeded ``n`` = 2 samples), arriving
    over the first steps."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 900) for _ in range(rng.randrange(8, 60))] for _ in range(4)]
    arrivals = []
    for i in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(5, 900) for _ in range(rng.randrange(1, 20))]
        n = rng.choice([1, 1, 2])
        params = SamplingParams(
            n=n,
            temperature=0 if n == 1 else 0.8,
            seed=rng.randrange(1 << 20),
            max_tokens=rng.randrange(1, 40),
            ignore_eos=True,
        )
        arrivals.append(Arrival(f"r{i}", prompt, params, 3 * rng.randrange(0, 3)))
    return arrivals


def run_workload(
    model: Path,
    arrivals: list[Arrival],
    check: bool,
    prepare: Callable[[LLMEngine], None] | None = None,
    **config: object,
) -> tuple[dict[str, list[tuple[int, ...]]], LLMEngine]:
    """Run ``arrivals`` to the end on a new engine (blocks of ``WORKLOAD_BLOCK_SIZE``, at most 6
    sequences and 64 tokens a step; ``config``: more ``EngineConfig`` fields); ``check``: the
    engine's ``check_integrity`` after every step. Each request's sorted samples, and the engine."""
    engine = make_engine(
        model, block_size=WORKLOAD_BLOCK_SIZE, max_num_seqs=6, max_num_batched_tokens=64, **config
    )
    if prepare is not None:
        prepare(engine)
    pending = sorted(arrivals, key=lambda a: a.step)
    outputs: dict[str, list[tuple[int, ...]]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and (pending[0].step <= step or not engine.has_unfinished_requests()):
            a = pending.pop(0)
            engine.add_request(a.request_id, a.prompt, a.params)
        for out in engine.step():
            if out.finished:
                assert out.error is None, (out.request_id, out.error)
                outputs[out.request_id] = sorted(tuple(c.token_ids) for c in out.outputs)
        if check:
            engine.check_integrity()
        step += 1
    engine.check_integrity()
    assert engine.kv.block_manager.num_free_blocks == engine.kv.block_manager.num_blocks
    return outputs, engine
