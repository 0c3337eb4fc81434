"""Two ``loraplex serve`` processes sharing one PostgreSQL database, one Redis and one adapter folder,
as the Helm chart's replicas do: what one replica changes, the other serves.

| change on replica A | seen on replica B | bound |
|---|---|---|
| a key made | it authenticates | next request (an unknown key is looked up in the database) |
| an adapter (re-)uploaded | its newest version, the greedy tokens A gives | next request |
| a key revoked | 401 | ``auth_cache_ttl_s`` (the key checks' cache; 2 s here, 60 s default) |
| an rpm quota spent | one count across both | Redis (one Lua call per admission) |
| a tenant deleted | its cached KV purged | Redis pub/sub delivery + one engine step (test allows 15 s) |
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from support.adapters import make_small_adapter
from support.gateway import zip_bytes
from support.replicas import ADMIN, AUTH_CACHE_TTL_S, BASE, PROMPT, Replica, start_replica, tenant_key


@pytest.fixture
def replicas(
    tmp_path: Path, tiny_dirs: dict[str, Path], database_url: str, redis_url: str, redis_key_prefix: str
) -> Iterator[tuple[Replica, Replica]]:
    shared = {
        "LORAPLEX_DATABASE_URL": database_url,
        "LORAPLEX_REDIS_URL": redis_url,
        "LORAPLEX_QUOTA_KEY_PREFIX": redis_key_prefix,
        "LORAPLEX_QUOTA_WINDOW_S": "60",
        "LORAPLEX_ADAPTER_STORE": str(tmp_path / "shared-adapters"),
    }
    a = start_replica("a", tmp_path, tiny_dirs["gqa_tied"], shared)
    b = start_replica("b", tmp_path, tiny_dirs["gqa_tied"], shared)
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b
    finally:
        a.stop()
        b.stop()


def strong_adapter(base: Path, out: Path, seed: int) -> bytes:
    """A LoRA strong enough that two seeds change the tiny model's greedy tokens; as a .zip."""
    make_small_adapter(base, out, rank=4, seed=seed)
    weights = out / "adapter_model.safetensors"
    save_file({k: v * 40 for k, v in load_file(str(weights)).items()}, str(weights))
    return zip_bytes(out)


def complete(replica: Replica, key: str, model: str = BASE, prompt: list[int] = PROMPT) -> httpx.Response:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    return replica.client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def tokens(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["logprobs"]["tokens"])


def upload(replica: Replica, key: str, name: str, archive: bytes) -> None:
    r = replica.client.post(
        "/v1/adapters",
        data={"name": name, "visibility": "private"},
        files={"file": ("adapter.zip", archive, "application/octet-stream")},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert r.status_code in (200, 201), r.text


def wait_for_log(replica: Replica, text: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in replica.log.read_text().splitlines():
            if text in line:
                return line
        time.sleep(0.1)
    raise AssertionError(f"{replica.name} never logged {text!r}:\n{replica.log.read_text()[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_two_replicas_share_tenants_keys_adapters_quotas_and_purges(
    replicas: tuple[Replica, Replica], tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    a, b = replicas
    base = tiny_dirs["gqa_tied"]
    torch.manual_seed(0)

    # A key made on A works on B.
    key, key_id = tenant_key(a, "acme")
    assert complete(b, key).status_code == 200

    # Upload on A, complete on B: the same greedy tokens.
    upload(a, key, "style", strong_adapter(base, tmp_path / "v1", seed=1))
    first = tokens(complete(a, key, "style"))
    assert tokens(complete(b, key, "style")) == first
    assert first != tokens(complete(b, key)), "the adapter changes nothing: the test would prove nothing"

    # Re-upload on A: B serves the new version at its next request.
    upload(a, key, "style", strong_adapter(base, tmp_path / "v2", seed=2))
    second = tokens(complete(a, key, "style"))
    assert second != first
    assert tokens(complete(b, key, "style")) == second

    # Revoke on A: refused on B once its cached check of the key expires.
    assert a.client.delete(f"/admin/api/keys/{key_id}", headers=ADMIN).status_code in (200, 204)
    revoked_at = time.monotonic()
    assert complete(a, key).status_code == 401
    while complete(b, key, prompt=[5]).status_code != 401:
        assert time.monotonic() - revoked_at < AUTH_CACHE_TTL_S + 10, "B still accepts a revoked key"
        time.sleep(0.2)

    # An rpm quota is one count across both replicas.
    metered, _ = tenant_key(b, "metered", rpm=4)
    codes = [complete(replica, metered, prompt=[5, 6, 7]).status_code for replica in (a, b, a, b, a, b)]
    assert codes == [200, 200, 200, 200, 429, 429]

    # A tenant deleted on A has its cached KV purged on B.
    doomed, _ = tenant_key(a, "doomed")
    assert complete(b, doomed).status_code == 200
    cached = complete(b, doomed).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 32  # B holds its two full prompt blocks
    r = a.client.delete("/admin/api/tenants/doomed", headers=ADMIN)
    assert r.status_code in (200, 204), r.text
    line = wait_for_log(b, "was deleted on another replica: purged", timeout_s=15)
    assert int(line.split("purged ")[1].split()[0]) >= 2, line
    assert "was deleted on another replica" not in a.log.read_text()  # A purged its own, once
