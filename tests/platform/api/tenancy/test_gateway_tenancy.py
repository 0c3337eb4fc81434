"""Tenancy through the gateway's HTTP API: keys, adapter visibility, quotas.

Each test runs twice (``database_url``): SQLite with the in-process limiter, and PostgreSQL with
Redis. Quotas run with a short window so that recovering takes seconds, not a minute.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from fastapi import FastAPI
from support.gateway import (
    ADMIN,
    BASE,
    Admin,
    bearer,
    completion_body,
    make_gateway,
    serving,
    settings_for,
    upload,
    zip_bytes,
)

from loraplex.platform.engine.async_engine import AsyncEngine

WINDOW_S = 2.0
MakeApp = Callable[..., FastAPI]


@pytest_asyncio.fixture
async def make_app(
    request: pytest.FixtureRequest, database_url: str, gateway_engine: AsyncEngine, tmp_path: Path
) -> AsyncIterator[MakeApp]:
    """A gateway on this test's database: SQLite + in-process quotas, or PostgreSQL + Redis."""
    redis: dict[str, Any] = {}
    if database_url.startswith("postgresql"):
        redis = dict(
            redis_url=request.getfixturevalue("redis_url"),
            quota_key_prefix=request.getfixturevalue("redis_key_prefix"),
        )

    def make(**settings: Any) -> FastAPI:
        values = {"quota_window_s": WINDOW_S, **redis, **settings}
        return make_gateway(gateway_engine, settings_for(tmp_path, database_url, **values))

    yield make


@pytest_asyncio.fixture
async def client(make_app: MakeApp) -> AsyncIterator[httpx.AsyncClient]:
    async with serving(make_app()) as c:
        yield c


async def complete(client: httpx.AsyncClient, key: str, model: str = BASE, **kw: Any) -> httpx.Response:
    return await client.post("/v1/completions", json=completion_body(model, **kw), headers=bearer(key))


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


# -- prefix cache --------------------------------------------------------------------------------


def cached_tokens(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.asyncio
async def test_prefix_cache_hits_within_a_tenant_and_never_across(client: httpx.AsyncClient) -> None:
    # The gateway salts the cache with the key's tenant (id, name, creation time): the same
    # prompt hits for its own tenant only, and a tenant re-created under an old name starts
    # cold. Tokens only this test sends (the engine, and its cache, serve the whole module).
    admin = Admin(client)
    acme, globex = await admin.tenant_with_key("acme"), await admin.tenant_with_key("globex")
    block = 16  # the engine's default block size
    prompt = [3000 + (37 * i) % 1000 for i in range(3 * block + 4)]
    first = await complete(client, acme, prompt=prompt)
    again = await complete(client, acme, prompt=prompt)
    other = await complete(client, globex, prompt=prompt)
    assert (cached_tokens(first), cached_tokens(again), cached_tokens(other)) == (0, 3 * block, 0)
    assert (
        first.json()["choices"][0]["text"]
        == again.json()["choices"][0]["text"]
        == other.json()["choices"][0]["text"]
    )
    assert (await client.delete("/admin/api/tenants/acme", headers=ADMIN)).status_code == 200
    reborn = await admin.tenant_with_key("acme")
    assert cached_tokens(await complete(client, reborn, prompt=prompt)) == 0
    assert cached_tokens(await complete(client, globex, prompt=prompt)) == 3 * block


# -- keys ----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.asyncio
async def test_key_lifecycle(client: httpx.AsyncClient) -> None:
    admin = Admin(client)
    await admin.tenant("acme")
    created = await client.post("/admin/api/tenants/acme/keys", json={"name": "ci"}, headers=ADMIN)
    assert created.status_code == 201
    key, key_id, prefix = created.json()["key"], created.json()["id"], created.json()["prefix"]
    assert key.startswith(prefix) and len(key) > len(prefix) + 16
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 200
    assert (await complete(client, key)).status_code == 200

    listed = (await client.get("/admin/api/tenants/acme/keys", headers=ADMIN)).json()["data"]
    assert [(k["id"], k["prefix"], k["name"]) for k in listed] == [(key_id, prefix, "ci")]
    assert key not in str(listed) and listed[0]["last_used_at"] is not None

    refusals = {}
    wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    refusals["wrong"] = await complete(client, wrong)
    refusals["garbage"] = await complete(client, "not-a-key")
    revoked = await client.delete(f"/admin/api/keys/{key_id}", headers=ADMIN)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    refusals["revoked"] = await complete(client, key)
    soon = datetime.now(UTC) + timedelta(seconds=1)
    expiring = await admin.key("acme", expires_at=soon.isoformat())
    assert (await complete(client, expiring)).status_code == 200
    await asyncio.sleep(max(0.0, (soon - datetime.now(UTC)).total_seconds()) + 0.1)
    refusals["expired"] = await complete(client, expiring)
    for why, response in refusals.items():
        assert response.status_code == 401, why
        assert response.headers["www-authenticate"] == "Bearer"
        assert error_of(response)["code"] == "invalid_api_key"
    # Nothing tells a revoked or expired key from a wrong one.
    assert len({r.text for r in refusals.values()}) == 1

    missing = await client.post("/v1/completions", json=completion_body(BASE))
    basic = await client.get("/v1/models", headers={"Authorization": "Basic abc"})
    for response in (missing, basic):
        assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"

    # A disabled tenant's keys stop working; enabled again, they work again.
    fresh = await admin.key("acme")
    await client.patch("/admin/api/tenants/acme", json={"disabled": True}, headers=ADMIN)
    assert (await complete(client, fresh)).status_code == 401
    await client.patch("/admin/api/tenants/acme", json={"disabled": False}, headers=ADMIN)
    assert (await complete(client, fresh)).status_code == 200


# -- adapters across tenants ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_private_adapter_is_invisible_to_others_and_public_one_usable(
    client: httpx.AsyncClient, peft_adapter_dir: Path
) -> None:
    admin = Admin(client)
    key_a = await admin.tenant_with_key("alpha")
    key_b = await admin.tenant_with_key("beta")
    archive = zip_bytes(peft_adapter_dir)
    assert (await upload(client, key_a, "secret", archive)).status_code == 201
    assert (await upload(client, key_a, "shared", archive, visibility="public")).status_code == 201

    models_b = [m["id"] for m in (await client.get("/v1/models", headers=bearer(key_b))).json()["data"]]
    assert models_b == [BASE, "alpha/shared"]
    models_a = [m["id"] for m in (await client.get("/v1/models", headers=bearer(key_a))).json()["data"]]
    assert models_a == [BASE, "secret", "shared"]

    # B cannot use, see or delete A's private adapter, and cannot tell it from a missing one.
    private = await complete(client, key_b, "alpha/secret")
    missing = await complete(client, key_b, "alpha/nothing")
    bare = await complete(client, key_b, "secret")
    for response in (private, missing, bare):
        assert response.status_code == 404
        assert error_of(response)["code"] == "model_not_found"
    assert error_of(private)["message"].replace("alpha/secret", "X") == error_of(missing)["message"].replace(
        "alpha/nothing", "X"
    )
    assert (await client.get("/v1/models/alpha/secret", headers=bearer(key_b))).status_code == 404
    assert (await client.get("/v1/adapters/secret", headers=bearer(key_b))).status_code == 404
    assert (await client.delete("/v1/adapters/secret", headers=bearer(key_b))).status_code == 404
    assert (await client.get("/v1/adapters", headers=bearer(key_b))).json()["data"] == []
    assert (await client.get("/v1/adapters/secret", headers=bearer(key_a))).status_code == 200

    # B uses A's public adapter by owner/name and gets what A gets with it.
    shared_b = await complete(client, key_b, "alpha/shared")
    shared_a = await complete(client, key_a, "shared")
    secret_a = await complete(client, key_a, "alpha/secret")
    for response in (shared_b, shared_a, secret_a):
        assert response.status_code == 200, response.text
    assert shared_b.json()["model"] == "alpha/shared"
    assert shared_b.json()["choices"][0]["text"] == shared_a.json()["choices"][0]["text"]

    # A deletes its private adapter: gone for A too, and its version's folder stays (shared
    # content: "shared" holds the same version).
    deleted = await client.delete("/v1/adapters/secret", headers=bearer(key_a))
    assert deleted.status_code == 200 and len(deleted.json()["versions"]) == 1
    assert (await complete(client, key_a, "secret")).status_code == 404
    assert (await complete(client, key_b, "alpha/shared")).status_code == 200


# -- quotas --------------------------------------------------------------------------------------


def retry_after_s(response: httpx.Response) -> int:
    value = int(response.headers["retry-after"])
    assert 1 <= value <= WINDOW_S + 1
    return value


@pytest.mark.slow
@pytest.mark.asyncio
async def test_rpm_limit_refuses_the_request_after_the_limit_and_recovers(client: httpx.AsyncClient) -> None:
    key = await Admin(client).tenant_with_key("acme", rpm=3)
    started = time.monotonic()
    answers = [await complete(client, key, max_tokens=1) for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert (
        error_of(answers[3])["code"] == "rate_limit_exceeded"
        and "3 requests" in error_of(answers[3])["message"]
    )
    retry_after_s(answers[3])
    await asyncio.sleep(max(0.0, started + WINDOW_S + 0.2 - time.monotonic()))
    assert (await complete(client, key, max_tokens=1)).status_code == 200


@pytest.mark.slow
@pytest.mark.asyncio
async def test_tpm_limit_reserves_max_tokens_and_refunds_what_was_not_used(client: httpx.AsyncClient) -> None:
    admin = Admin(client)
    probe = await complete(client, await admin.tenant_with_key("probe"), max_tokens=2)
    first_token_text = probe.json()["choices"][0]["text"]
    key = await admin.tenant_with_key("acme", tpm=20)

    # Reserves 3 + 16 = 19 of 20; stops after one token, so it settles at 3 + 1 = 4.
    short = await complete(client, key, max_tokens=16, stop=[first_token_text.split()[0]], ignore_eos=False)
    assert short.status_code == 200, short.text
    assert short.json()["usage"] == {**short.json()["usage"], "prompt_tokens": 3}
    used = 3 + short.json()["usage"]["completion_tokens"]
    assert used < 19
    # 20 - used tokens are left: a reservation of exactly that fits, one more does not.
    fits = await complete(client, key, max_tokens=20 - used - 3)
    assert fits.status_code == 200, fits.text
    over = await complete(client, key, max_tokens=1)
    assert over.status_code == 429 and error_of(over)["type"] == "tokens"
    retry_after_s(over)
    # A request that could never fit says so, without Retry-After.
    never = await complete(client, key, max_tokens=100)
    assert never.status_code == 429 and "retry-after" not in never.headers
    assert "more than the limit" in error_of(never)["message"]
    await asyncio.sleep(WINDOW_S + 0.2)
    assert (await complete(client, key, max_tokens=4)).status_code == 200


@pytest.mark.slow
@pytest.mark.asyncio
async def test_concurrency_limit(client: httpx.AsyncClient, gateway_engine: AsyncEngine) -> None:
    key = await Admin(client).tenant_with_key("acme", max_concurrency=1)
    long = asyncio.create_task(complete(client, key, max_tokens=400))
    deadline = time.monotonic() + 30
    while not gateway_engine.stats.num_unfinished:
        assert time.monotonic() < deadline and not long.done(), "the long request never started"
        await asyncio.sleep(0.005)
    second = await complete(client, key, max_tokens=1)
    assert not long.done(), "the long request ended before the second one was admitted"
    assert second.status_code == 429 and "1 requests in flight" in error_of(second)["message"]
    assert second.headers["retry-after"] == "1"
    assert (await long).status_code == 200
    assert (await complete(client, key, max_tokens=1)).status_code == 200


@pytest.mark.asyncio
async def test_quotas_are_per_tenant_and_changes_apply_at_once(client: httpx.AsyncClient) -> None:
    admin = Admin(client)
    limited = await admin.tenant_with_key("limited", rpm=1)
    other = await admin.tenant_with_key("other")
    assert (await complete(client, limited, max_tokens=1)).status_code == 200
    assert (await complete(client, limited, max_tokens=1)).status_code == 429
    assert all([(await complete(client, other, max_tokens=1)).status_code == 200 for _ in range(3)])
    raised = await client.patch("/admin/api/tenants/limited", json={"rpm": None}, headers=ADMIN)
    assert raised.status_code == 200 and raised.json()["rpm"] is None
    assert (await complete(client, limited, max_tokens=1)).status_code == 200


# -- Redis across replicas -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_two_gateway_instances_share_one_redis_limit(
    gateway_engine: AsyncEngine, tmp_path: Path, redis_url: str, redis_key_prefix: str
) -> None:
    shared = dict(redis_url=redis_url, quota_key_prefix=redis_key_prefix, quota_window_s=30.0)
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'shared.db'}"
    one = make_gateway(gateway_engine, settings_for(tmp_path / "one", database_url, **shared))
    two = make_gateway(gateway_engine, settings_for(tmp_path / "two", database_url, **shared))
    async with serving(one) as a, serving(two) as b:
        key = await Admin(a).tenant_with_key("acme", rpm=4)
        codes = [(await complete(c, key, max_tokens=1)).status_code for c in (a, b, a, b, a, b)]
    assert codes == [200, 200, 200, 200, 429, 429]


@pytest.mark.slow
@pytest.mark.asyncio
async def test_redis_outage_follows_the_policy_and_recovers(
    gateway_engine: AsyncEngine, tmp_path: Path, redis_process: Any
) -> None:
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    closed = make_gateway(gateway_engine, settings_for(tmp_path, database_url, redis_url=redis_process.url))
    async with serving(closed) as client:
        admin = Admin(client)
        limited = await admin.tenant_with_key("limited", rpm=100)
        unlimited = await admin.tenant_with_key("unlimited")
        assert (await complete(client, limited, max_tokens=1)).status_code == 200
        redis_process.kill()
        down = await complete(client, limited, max_tokens=1)
        assert down.status_code == 503 and down.headers["retry-after"] == "1"
        assert error_of(down)["code"] == "quota_unavailable"
        assert (await complete(client, unlimited, max_tokens=1)).status_code == 200  # no quota to check
        redis_process.start()
        deadline = time.monotonic() + 10
        while (await complete(client, limited, max_tokens=1)).status_code != 200:
            assert time.monotonic() < deadline, "the gateway did not recover when Redis came back"
            await asyncio.sleep(0.2)
        redis_process.kill()
    fail_open = dict(redis_url=redis_process.url, quota_failure_policy="fail_open")
    opened = make_gateway(gateway_engine, settings_for(tmp_path, database_url, **fail_open))
    async with serving(opened) as client:
        assert (await complete(client, limited, max_tokens=1)).status_code == 200
