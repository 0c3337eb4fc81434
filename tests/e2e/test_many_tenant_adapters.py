"""200 tenants, each with its own uploaded adapter, served at once (issue 29, acceptance 4).

A real uvicorn gateway on loopback over the tiny GQA model. Each of ``NUM_TENANTS`` tenants gets
its own key and uploads its own random PEFT LoRA (q_proj + v_proj, rank 4 or 8), every one under
the same name, so a request resolved to another tenant's adapter would be served without an
error and only its tokens would tell. Then all completions go out at once (one asyncio task and
one connection each) and:

- every response is 200 (no 5xx and no 429: the tenants have no quotas, which means unlimited,
  and ``max_queued_requests`` (512 by default) is above ``NUM_TENANTS``);
- every tenant's greedy tokens equal the offline engine's (``LLM``, same model folder) for that
  tenant's adapter folder;
- the adapters matter: nearly every tenant's tokens differ from the base model's, and nearly all
  tenants' tokens differ from each other (checked on the offline side too, so the test cannot
  pass by everyone getting the same answer).

The engine runs with its defaults for adapters (no ``max_loras``): today that is 4 device slots,
so the 200 adapters cycle through them (and through the host LRU and the store); after the paged
adapter memory of issue 29 it means "as many as fit". The test checks correctness, not speed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file, save_file
from support.adapters import make_small_adapter
from support.gateway import ADMIN, bearer, make_gateway, settings_for, zip_bytes
from support.ports import free_port

from loraplex import LLM, SamplingParams
from loraplex.adapters import LoRARequest
from loraplex.platform.api.server import Server
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine

pytestmark = pytest.mark.slow

NUM_TENANTS = 200
ADAPTER_NAME = "own"  # every tenant's adapter has this name: only the tenant tells them apart
BASE = "tiny"
PROMPT = [5 + (7 * i) % 300 for i in range(20)]  # 20 tokens: one full KV block and a partial one
MAX_TOKENS = 8
# One pool for KV and adapter pages: 200 sequences x 2 blocks and 200 rank-8 q/v adapters (8
# blocks each on the tiny model) fit at once: no preemption or eviction needed (not a KV test).
NUM_KV_BLOCKS = 4096
STRENGTH = 40.0  # scales A and B so each random adapter moves the tiny model's greedy tokens


@dataclass
class Live:
    url: str
    engine: AsyncEngine


# The gateway's and the offline engine's settings: the adapter settings stay at their defaults
# (no max_loras, no max_lora_rank), so the test holds across the slot -> paged memory change.
ENGINE_ARGS: dict[str, Any] = dict(dtype="float32", enable_lora=True, num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture
def gateway(tiny_dirs: dict[str, Path], tmp_path: Path) -> Iterator[Live]:
    """A multi-tenant gateway on a loopback port with its own SQLite database and adapter store."""
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_dirs["gqa_tied"]), **ENGINE_ARGS)))
    root = tmp_path / "gateway"
    settings = settings_for(root, f"sqlite+aiosqlite:///{tmp_path / 'g.db'}", host="127.0.0.1")
    port = free_port()
    server = Server(make_gateway(engine, settings), "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.05)
    try:
        yield Live(f"http://127.0.0.1:{port}", engine)
    finally:
        server.stop()  # shuts the engine down too
        thread.join(60)


def tenant_adapter(base: Path, out: Path, index: int) -> Path:
    """Tenant ``index``'s PEFT LoRA folder: its own seed, rank 4 or 8 (mixed ranks in one batch)."""
    make_small_adapter(base, out, rank=4 if index % 2 else 8, seed=1000 + index)
    weights = out / "adapter_model.safetensors"
    save_file({k: v * STRENGTH for k, v in load_file(str(weights)).items()}, str(weights))
    return out


async def create_tenant(admin: httpx.AsyncClient, name: str) -> str:
    """A tenant with no quotas (unlimited) and one key."""
    created = await admin.post("/admin/api/tenants", json={"name": name}, headers=ADMIN)
    assert created.status_code == 201, created.text
    key = await admin.post(f"/admin/api/tenants/{name}/keys", json={}, headers=ADMIN)
    assert key.status_code == 201, key.text
    return str(key.json()["key"])


async def upload_adapter(client: httpx.AsyncClient, key: str, folder: Path) -> None:
    r = await client.post(
        "/v1/adapters",
        data={"name": ADAPTER_NAME, "visibility": "private"},
        files={"file": ("adapter.zip", zip_bytes(folder), "application/zip")},
        headers=bearer(key),
    )
    assert r.status_code == 201, r.text


def completion(model: str) -> dict[str, object]:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,  # the sampled tokens, one string each
    }


async def complete(client: httpx.AsyncClient, key: str, model: str) -> httpx.Response:
    return await client.post("/v1/completions", json=completion(model), headers=bearer(key))


def served(response: httpx.Response) -> tuple[str, list[str]]:
    """The completion's text and its tokens (each token's text, as the engine decodes one)."""
    choice = response.json()["choices"][0]
    assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS, response.text
    return str(choice["text"]), list(choice["logprobs"]["tokens"])


def offline(model: Path, folders: list[Path]) -> tuple[list[tuple[str, list[str]]], tuple[str, list[str]]]:
    """The offline engine's (text, token texts) for each adapter folder, and for the base model."""
    llm = LLM(str(model), **ENGINE_ARGS)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        loras: list[LoRARequest | None] = [
            LoRARequest(f"tenant-{i}", i + 1, str(f)) for i, f in enumerate(folders)
        ]
        outs = llm.generate(
            [PROMPT] * (len(folders) + 1), params, lora_request=[*loras, None], use_tqdm=False
        )
        tok = llm.get_tokenizer()
        result = [(o.outputs[0].text, [str(tok.decode([t])) for t in o.outputs[0].token_ids]) for o in outs]
    finally:
        llm.shutdown()
    return result[:-1], result[-1]


def test_200_tenants_each_complete_with_their_own_adapter_concurrently(
    gateway: Live, tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    base = tiny_dirs["gqa_tied"]
    folders = [tenant_adapter(base, tmp_path / "adapters" / f"t{i:03d}", i) for i in range(NUM_TENANTS)]
    names = [f"tenant-{i:03d}" for i in range(NUM_TENANTS)]

    async def run() -> tuple[list[httpx.Response], httpx.Response, dict[str, float]]:
        times: dict[str, float] = {}
        # keepalive_expiry below uvicorn's 5 s keep-alive timeout: a pooled connection idle for
        # longer may be closed by the server just as a request goes out on it (a ReadError that
        # is the client's race, not the gateway's; it hit under a loaded machine).
        limits = httpx.Limits(
            max_connections=NUM_TENANTS + 8, max_keepalive_connections=NUM_TENANTS + 8, keepalive_expiry=2.0
        )
        async with httpx.AsyncClient(base_url=gateway.url, timeout=300, limits=limits) as client:
            t0 = time.monotonic()
            keys = [await create_tenant(client, name) for name in names]
            times["tenants_and_keys_s"] = time.monotonic() - t0
            t0 = time.monotonic()
            await asyncio.gather(*(upload_adapter(client, k, f) for k, f in zip(keys, folders, strict=True)))
            times["uploads_s"] = time.monotonic() - t0
            base_response = await complete(client, keys[0], BASE)
            t0 = time.monotonic()
            responses = await asyncio.gather(*(complete(client, k, ADAPTER_NAME) for k in keys))
            times["completions_s"] = time.monotonic() - t0
        return list(responses), base_response, times

    responses, base_response, times = asyncio.run(run())
    print(f"\n{NUM_TENANTS} tenants: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))

    codes = [r.status_code for r in responses]
    failed = {
        n: (r.status_code, r.text[:200])
        for n, r in zip(names, responses, strict=True)
        if r.status_code != 200
    }
    assert not failed, f"{len(failed)} of {NUM_TENANTS} not 200 (codes {sorted(set(codes))}): {failed}"
    assert base_response.status_code == 200, base_response.text
    got = [served(r) for r in responses]

    want, want_base = offline(base, folders)
    mismatched = [n for n, g, w in zip(names, got, want, strict=True) if g != w]
    assert not mismatched, (
        f"{len(mismatched)} tenants' tokens differ from the offline engine's for their adapter, e.g. "
        + "; ".join(
            f"{n}: served {g[1]} offline {w[1]}" for n, g, w in zip(names, got, want, strict=True) if g != w
        )[:2000]
    )

    # The adapters matter, so the equality above could catch a tenant served another's adapter.
    assert served(base_response) == want_base, "the base model's tokens differ from the offline engine's"
    same_as_base = sum(w == want_base for w in want)
    distinct = len({tuple(w[1]) for w in want})
    print(f"offline: {same_as_base} adapters give the base model's tokens, {distinct} distinct outputs")
    assert same_as_base <= NUM_TENANTS // 20, (
        f"{same_as_base} adapters change nothing: too weak to tell apart"
    )
    assert distinct >= NUM_TENANTS * 9 // 10, f"only {distinct} distinct outputs among {NUM_TENANTS} adapters"
