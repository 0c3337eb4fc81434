"""Prefix caching in the engine: hits give the same tokens, and never cross adapters or tenants."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
from support.adapters import make_peft_adapter
from support.engines import tiny_engine

from loraplex import LoRARequest, SamplingParams
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.outputs import RequestOutput

BLOCK = 8
PROMPT = [(7 * i) % 500 + 3 for i in range(45)]  # 5 full blocks + 5 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("prefix-adapters")
    spec = dict(r=4, target_modules=["q_proj", "v_proj"])
    make_peft_adapter(tiny_dirs["gqa_tied"], root / "a", seed=11, spec=spec)
    # A re-upload with other weights: a new content version (the engine registers it under
    # its own id; the gateway maps the same public name to the newest version).
    make_peft_adapter(tiny_dirs["gqa_tied"], root / "a2", seed=12, spec=spec)
    return [LoRARequest("a", 1, str(root / "a")), LoRARequest("a-reuploaded", 2, str(root / "a2"))]


_engine = partial(
    tiny_engine, block_size=BLOCK, num_kv_blocks=128, enable_lora=True, max_loras=2, max_lora_rank=8
)


def _run(
    engine: LLMEngine,
    rid: str,
    prompt: list[int],
    lora: LoRARequest | None = None,
    tenant: str | None = None,
) -> RequestOutput:
    engine.add_request(rid, prompt, GREEDY, lora_request=lora, tenant_id=tenant)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None and final.error is None
    return final


def test_hits_share_full_blocks_and_give_the_same_tokens(tiny_dirs: dict[str, Path]) -> None:
    off = _run(_engine(tiny_dirs, enable_prefix_caching=False), "off", PROMPT)
    engine = _engine(tiny_dirs)
    first = _run(engine, "first", PROMPT)
    second = _run(engine, "second", PROMPT)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 5 * BLOCK  # every full block; the last token is recomputed
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == off.outputs[0].token_ids
    engine.check_integrity()
    assert engine.kv.block_manager.num_free_blocks == engine.kv.block_manager.num_blocks


@pytest.mark.parametrize("length", [4 * BLOCK, 4 * BLOCK + 1, 4 * BLOCK - 1])
def test_the_last_prompt_token_is_always_computed(tiny_dirs: dict[str, Path], length: int) -> None:
    engine = _engine(tiny_dirs)
    _run(engine, "warm", PROMPT[:length])
    again = _run(engine, "again", PROMPT[:length])
    assert again.num_cached_tokens == (length - 1) // BLOCK * BLOCK


def test_no_hit_across_adapters_versions_tenants_or_the_base_model(
    tiny_dirs: dict[str, Path], adapters: list[LoRARequest]
) -> None:
    v1, v2 = adapters
    engine = _engine(tiny_dirs)
    _run(engine, "warm", PROMPT, lora=v1, tenant="acme")
    assert _run(engine, "same", PROMPT, lora=v1, tenant="acme").num_cached_tokens == 5 * BLOCK
    assert _run(engine, "new-version", PROMPT, lora=v2, tenant="acme").num_cached_tokens == 0
    assert _run(engine, "base", PROMPT, tenant="acme").num_cached_tokens == 0
    assert _run(engine, "other-tenant", PROMPT, lora=v1, tenant="globex").num_cached_tokens == 0
    assert _run(engine, "offline", PROMPT, lora=v1).num_cached_tokens == 0
    engine.check_integrity()


@pytest.mark.slow
def test_isolation_holds_across_the_disk_tier_and_a_restart(
    tiny_dirs: dict[str, Path], adapters: list[LoRARequest], tmp_path: Path
) -> None:
    # The blocks a restarted engine finds on disk keep the adapter version and the tenant
    # they were computed for (peers drop the salt at the tier boundary).
    v1, v2 = adapters
    disk = dict(disk_kv_path=str(tmp_path / "kv"), disk_kv_cache_bytes=4 << 20)
    engine = _engine(tiny_dirs, **disk)
    warm = _run(engine, "warm", PROMPT, lora=v1, tenant="acme")
    engine.shutdown()  # the cached device blocks go to disk
    restarted = _engine(tiny_dirs, **disk)
    same = _run(restarted, "same", PROMPT, lora=v1, tenant="acme")
    assert same.num_cached_tokens == 5 * BLOCK and same.outputs[0].token_ids == warm.outputs[0].token_ids
    assert _run(restarted, "new-version", PROMPT, lora=v2, tenant="acme").num_cached_tokens == 0
    assert _run(restarted, "base", PROMPT, tenant="acme").num_cached_tokens == 0
    assert _run(restarted, "other-tenant", PROMPT, lora=v1, tenant="globex").num_cached_tokens == 0
    assert _run(restarted, "offline", PROMPT, lora=v1).num_cached_tokens == 0
    restarted.check_integrity()
    restarted.shutdown()
