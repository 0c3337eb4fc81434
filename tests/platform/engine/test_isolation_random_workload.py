"""Prefix-cache isolation as a property of a drawn workload, through every KV tier.

Forty-eight greedy requests over three shared prefixes, each under one of (base model,
adapter a, adapter b) and one of (no tenant, acme, globex), go through a pool small enough
that blocks move down to host and disk and come back. Two oracles:

- tokens: every request gets what the cache-off engine gives it;
- isolation: a request's ``num_cached_tokens`` never exceeds the full blocks it shares with
  the prompt and output of a request added before it under the *same* adapter and tenant
  (a hit on anyone else's blocks would show up as more).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.adapters import make_peft_adapter

from loraplex import LoRARequest, SamplingParams
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine

BLOCK = 8
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # the tiny gqa model: 2 layers, K and V, 2 KV heads of 16, float32
TENANTS = (None, "acme", "globex")


@dataclass(frozen=True)
class Req:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    adapter: int  # index into the adapters fixture (0 = base model)
    tenant: str | None


@pytest.fixture(scope="module")
def adapters(
    tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> list[LoRARequest | None]:
    root = tmp_path_factory.mktemp("iso-adapters")
    spec = dict(r=4, target_modules=["q_proj", "v_proj"])
    make_peft_adapter(tiny_dirs["gqa_tied"], root / "a", seed=11, spec=spec)
    make_peft_adapter(tiny_dirs["gqa_tied"], root / "b", seed=12, spec=spec)
    return [None, LoRARequest("a", 1, str(root / "a")), LoRARequest("b", 2, str(root / "b"))]


def draw(seed: int) -> list[Req]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 900) for _ in range(rng.randrange(8, 50))] for _ in range(3)]
    return [
        Req(
            f"r{i}",
            rng.choice(prefixes) + [rng.randrange(5, 900) for _ in range(rng.randrange(1, 12))],
            SamplingParams(temperature=0, max_tokens=rng.randrange(1, 20), ignore_eos=True),
            rng.randrange(3),
            rng.choice(TENANTS),
        )
        for i in range(48)
    ]


def run(
    model: Path, reqs: list[Req], adapters: list[LoRARequest | None], **config: object
) -> tuple[dict[str, list[int]], dict[str, int]]:
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            block_size=BLOCK,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
            **config,  # type: ignore[arg-type]
        )
    )
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    pending = list(reqs)  # added in order, at most 6 in the engine at once
    while pending or engine.has_unfinished_requests():
        if pending and len(engine.requests) < 6:
            r = pending.pop(0)
            engine.add_request(
                r.request_id, r.prompt, r.params, lora_request=adapters[r.adapter], tenant_id=r.tenant
            )
        for out in engine.step():
            if out.finished:
                assert out.error is None, (out.request_id, out.error)
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                cached[out.request_id] = out.num_cached_tokens
        engine.check_integrity()
    engine.shutdown()
    return tokens, cached


def shared_full_blocks(prompt: list[int], earlier: list[list[int]]) -> int:
    """Tokens of ``prompt`` a cache could serve from ``earlier`` sequences: whole blocks of
    the longest common prefix, never the last prompt token."""
    best = 0
    for seq in earlier:
        n = 0
        while n < min(len(prompt), len(seq)) and prompt[n] == seq[n]:
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1) // BLOCK * BLOCK


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 3])
def test_hits_never_cross_adapters_or_tenants_through_the_tiers(
    tiny_dirs: dict[str, Path], adapters: list[LoRARequest | None], tmp_path: Path, seed: int
) -> None:
    model, reqs = tiny_dirs["gqa_tied"], draw(seed)
    expected, _ = run(model, reqs, adapters, enable_prefix_caching=False, num_kv_blocks=400)
    tiers = dict(
        num_kv_blocks=20,
        host_kv_cache_bytes=16 * BLOCK_BYTES,
        disk_kv_path=str(tmp_path / "kv"),
        disk_kv_cache_bytes=1 << 20,
    )
    got, cached = run(model, reqs, adapters, **tiers)
    assert got == expected
    for i, r in enumerate(reqs):
        same_identity = [
            p.prompt + expected[p.request_id]
            for p in reqs[:i]
            if (p.adapter, p.tenant) == (r.adapter, r.tenant)
        ]
        assert cached[r.request_id] <= shared_full_blocks(r.prompt, same_identity), r
    assert sum(cached.values()) > 0, "the workload must hit"
