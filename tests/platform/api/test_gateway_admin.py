"""The admin API (tenants, keys, adapters, usage) and the open mode of a loopback gateway."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.adapters import make_small_adapter
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
from loraplex.platform.engine.engine import LLMEngine


def sqlite(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"


async def wait_for_usage(client: httpx.AsyncClient, query: str, count: int) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:
        report = (await client.get(f"/admin/api/usage?{query}", headers=ADMIN)).json()
        if report["num_requests"] >= count or time.monotonic() > deadline:
            assert report["num_requests"] == count, report
            return dict(report)
        await asyncio.sleep(0.05)


@pytest.mark.asyncio
async def test_admin_token(gateway_engine: AsyncEngine, tmp_path: Path) -> None:
    no_token = make_gateway(
        gateway_engine, settings_for(tmp_path / "a", sqlite(tmp_path / "a"), admin_token=None)
    )
    async with serving(no_token) as client:
        disabled = await client.get("/admin/api/tenants", headers=ADMIN)
        assert disabled.status_code == 403 and disabled.json()["error"]["code"] == "admin_disabled"
    async with serving(make_gateway(gateway_engine, settings_for(tmp_path, sqlite(tmp_path)))) as client:
        key = await Admin(client).tenant_with_key("acme")
        not_admin: list[dict[str, str]] = [{}, bearer("wrong-admin-token-0123456789"), bearer(key)]
        for headers in not_admin:
            refused = await client.get("/admin/api/tenants", headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_admin_token"


@pytest.mark.asyncio
async def test_tenants_keys_adapters_and_usage(
    gateway_engine: AsyncEngine, tmp_path: Path, peft_adapter_dir: Path
) -> None:
    settings = settings_for(tmp_path, sqlite(tmp_path))
    app = make_gateway(gateway_engine, settings)
    async with serving(app) as client:
        created = await client.post(
            "/admin/api/tenants", json={"name": "acme", "rpm": 2, "max_adapters": 3}, headers=ADMIN
        )
        assert created.status_code == 201
        assert (created.json()["rpm"], created.json()["tpm"], created.json()["max_adapters"]) == (2, None, 3)
        again = await client.post("/admin/api/tenants", json={"name": "acme"}, headers=ADMIN)
        assert again.status_code == 409
        bad_name = await client.post("/admin/api/tenants", json={"name": "Not/Valid"}, headers=ADMIN)
        assert bad_name.status_code == 400 and bad_name.json()["error"]["param"] == "name"
        typo = await client.post("/admin/api/tenants", json={"name": "x", "rmp": 3}, headers=ADMIN)
        assert typo.status_code == 400
        assert (await client.get("/admin/api/tenants/nobody", headers=ADMIN)).status_code == 404

        patched = await client.patch(
            "/admin/api/tenants/acme", json={"tpm": 1000, "rpm": None}, headers=ADMIN
        )
        assert (patched.json()["rpm"], patched.json()["tpm"], patched.json()["max_adapters"]) == (
            None,
            1000,
            3,
        )
        listed = (await client.get("/admin/api/tenants", headers=ADMIN)).json()["data"]
        assert [t["name"] for t in listed] == ["acme"]

        key = await Admin(client).key("acme")
        up = await upload(client, key, "fr", zip_bytes(peft_adapter_dir))
        assert up.status_code == 201
        version = up.json()["version"]
        assert (
            await client.post("/v1/completions", json=completion_body("fr"), headers=bearer(key))
        ).is_success
        assert (
            await client.post("/v1/completions", json=completion_body(BASE), headers=bearer(key))
        ).is_success
        over = await client.post(
            "/v1/completions", json=completion_body(BASE, max_tokens=2000), headers=bearer(key)
        )
        assert over.status_code == 429

        report = await wait_for_usage(client, "tenant=acme", 2)
        assert report["completion_tokens"] == 8 and report["prompt_tokens"] == 6
        # A refusal writes no usage row (it must cost nothing): the gateway counts it instead.
        assert [r["status"] for r in report["data"]] == ["ok", "ok"]
        assert app.state.loraplex.gateway.stats().num_quota_refusals == 1
        on_adapter = await wait_for_usage(client, "tenant=acme&adapter=fr", 1)
        assert on_adapter["data"][0]["adapter_version"] == version

        adapters = (await client.get("/admin/api/adapters?tenant=acme", headers=ADMIN)).json()["data"]
        assert [(a["owner"], a["name"], a["version"]) for a in adapters] == [("acme", "fr", version)]

        # Deleting the tenant takes its keys, adapters (files too) and usage with it.
        assert (settings.gateway.adapter_store_dir / version).is_dir()
        deleted = await client.delete("/admin/api/tenants/acme", headers=ADMIN)
        assert deleted.status_code == 200 and deleted.json()["adapters_removed"] == 1
        assert not (settings.gateway.adapter_store_dir / version).exists()
        assert (await client.get("/v1/models", headers=bearer(key))).status_code == 401
        assert (await client.get("/admin/api/usage", headers=ADMIN)).json()["num_requests"] == 0


@pytest.mark.asyncio
async def test_admin_deletes_a_tenants_adapter(
    gateway_engine: AsyncEngine, tmp_path: Path, peft_adapter_dir: Path
) -> None:
    settings = settings_for(tmp_path, sqlite(tmp_path))
    async with serving(make_gateway(gateway_engine, settings)) as client:
        key = await Admin(client).tenant_with_key("acme")
        version = (await upload(client, key, "fr", zip_bytes(peft_adapter_dir))).json()["version"]
        assert (
            await client.post("/v1/completions", json=completion_body("fr"), headers=bearer(key))
        ).is_success
        deleted = await client.delete("/admin/api/adapters/acme/fr", headers=ADMIN)
        assert deleted.status_code == 200 and deleted.json()["versions"] == [version]
        assert not (settings.gateway.adapter_store_dir / version).exists()
        gone = await client.post("/v1/completions", json=completion_body("fr"), headers=bearer(key))
        assert gone.status_code == 404
        assert (await client.delete("/admin/api/adapters/acme/fr", headers=ADMIN)).status_code == 404


@pytest.mark.asyncio
async def test_open_mode_runs_every_call_as_the_local_tenant(
    gateway_engine: AsyncEngine, tmp_path: Path, peft_adapter_dir: Path
) -> None:
    settings = settings_for(tmp_path, sqlite(tmp_path), auth="open", host="127.0.0.1")
    async with serving(make_gateway(gateway_engine, settings)) as client:
        client.base_url = httpx.URL("http://localhost:8000")  # open mode answers local names only
        # The README's first curl: no key at all.
        first = await client.post("/v1/completions", json=completion_body(BASE))
        assert first.status_code == 200, first.text
        up = await client.post(
            "/v1/adapters", data={"name": "mine"}, files={"file": ("a.zip", zip_bytes(peft_adapter_dir))}
        )
        assert up.status_code == 201 and up.json()["owner"] == "local"
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [BASE, "mine"]
        assert (await client.post("/v1/completions", json=completion_body("mine"))).status_code == 200
        await wait_for_usage(client, "tenant=local", 2)


@pytest.mark.asyncio
async def test_reupload_makes_a_new_version_that_new_requests_run_on(
    gateway_engine: AsyncEngine, tmp_path: Path, peft_adapter_dir: Path, tiny_dirs: dict[str, Path]
) -> None:
    settings = settings_for(tmp_path, sqlite(tmp_path))
    other = make_small_adapter(tiny_dirs["gqa_tied"], tmp_path / "v2", rank=4, seed=3)
    async with serving(make_gateway(gateway_engine, settings)) as client:
        key = await Admin(client).tenant_with_key("acme")
        v1 = (await upload(client, key, "fr", zip_bytes(peft_adapter_dir))).json()
        on_fr = completion_body("fr")
        assert (await client.post("/v1/completions", json=on_fr, headers=bearer(key))).is_success
        v2 = (await upload(client, key, "fr", zip_bytes(other))).json()
        assert v2["version"] != v1["version"]
        assert (await client.get("/v1/adapters/fr", headers=bearer(key))).json()["version"] == v2["version"]
        versions = (await client.get("/v1/adapters/fr/versions", headers=bearer(key))).json()["data"]
        assert [v["version"] for v in versions] == [v2["version"], v1["version"]]
        assert (await client.post("/v1/completions", json=on_fr, headers=bearer(key))).is_success
        report = await wait_for_usage(client, "tenant=acme", 2)
        assert [r["adapter_version"] for r in report["data"]] == [v2["version"], v1["version"]]
        # The engine now holds the new version only; the old one was unloaded when it was replaced.
        names = await gateway_engine.inspect(
            lambda engine: {info.name for info in engine.lora_runtime.adapter_manager.list_adapters()}  # type: ignore[union-attr]
        )
        assert any(n.startswith(f"acme/fr@{v2['version'][:12]}") for n in names)
        assert not any(n.startswith(f"acme/fr@{v1['version'][:12]}") for n in names)
        # The older content again is a conflict; deleting the newest serves the older one again.
        assert (await upload(client, key, "fr", zip_bytes(peft_adapter_dir))).status_code == 409
        dropped = await client.delete(f"/v1/adapters/fr?version={v2['version']}", headers=bearer(key))
        assert dropped.json()["versions"] == [v2["version"]]
        assert (await client.get("/v1/adapters/fr", headers=bearer(key))).json()["version"] == v1["version"]
        assert not (settings.gateway.adapter_store_dir / v2["version"]).exists()


@pytest.mark.asyncio
async def test_admin_resets_the_prefix_cache_only_when_idle(
    gateway_engine: AsyncEngine, tmp_path: Path
) -> None:
    from loraplex import SamplingParams

    async with serving(make_gateway(gateway_engine, settings_for(tmp_path, sqlite(tmp_path)))) as client:
        key = await Admin(client).tenant_with_key("acme")
        block = 16  # the engine's default block size
        body = completion_body(BASE, prompt=[2000 + (29 * i) % 900 for i in range(3 * block + 2)])

        async def cached() -> int:
            response = await client.post("/v1/completions", json=body, headers=bearer(key))
            assert response.status_code == 200, response.text
            return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert (await cached(), await cached()) == (0, 3 * block)
        refused = await client.post("/admin/api/prefix-cache/reset", headers=bearer(key))
        assert refused.status_code == 401  # a tenant key is not the admin token

        # A request still running (not read by anyone): the engine is busy, the reset waits.
        busy = await gateway_engine.add_request(
            "reset-busy", [7] * 8, SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
        )
        try:
            conflict = await client.post("/admin/api/prefix-cache/reset", headers=ADMIN)
        finally:
            busy.abort()
        assert conflict.status_code == 409 and conflict.headers["retry-after"] == "1"
        error = conflict.json()["error"]
        assert error["code"] == "engine_busy" and set(error) == {"message", "type", "param", "code"}
        assert await cached() == 3 * block  # nothing was dropped

        deadline = time.monotonic() + 10
        while (reset := await client.post("/admin/api/prefix-cache/reset", headers=ADMIN)).status_code == 409:
            assert time.monotonic() < deadline, "the aborted request never left the engine"
            await asyncio.sleep(0.05)
        assert reset.status_code == 200 and reset.json() == {"object": "prefix_cache.reset", "reset": True}
        assert (await cached(), await cached()) == (0, 3 * block)


@pytest.mark.asyncio
async def test_deleting_a_tenant_purges_its_cached_kv(gateway_engine: AsyncEngine, tmp_path: Path) -> None:
    from loraplex.platform.api.tenancy.tenant_gate import engine_tenant_id
    from loraplex.platform.engine.sequence import tenant_cache_salt
    from loraplex.storage.db import Database

    settings = settings_for(tmp_path, sqlite(tmp_path))
    async with serving(make_gateway(gateway_engine, settings)) as client:
        admin = Admin(client)
        acme, globex = await admin.tenant_with_key("acme"), await admin.tenant_with_key("globex")
        block = 16  # the engine's default block size
        body = completion_body(BASE, prompt=[4000 + (31 * i) % 800 for i in range(3 * block + 1)])
        for key in (acme, globex):
            assert (await client.post("/v1/completions", json=body, headers=bearer(key))).status_code == 200
        db = Database(sqlite(tmp_path))
        try:
            async with db.transaction() as session:
                from loraplex.platform.api.services import tenants

                salt = tenant_cache_salt(engine_tenant_id(await tenants.get_tenant(session, "acme")))
        finally:
            await db.dispose()

        def cached_of_acme(engine: LLMEngine) -> int:
            return sum(b.owner == salt for b in engine.kv.block_manager.pool.blocks if b.key is not None)

        assert await gateway_engine.inspect(cached_of_acme) == 3

        deleted = await client.delete("/admin/api/tenants/acme", headers=ADMIN)
        assert deleted.status_code == 200 and deleted.json()["kv_blocks_purged"] == 3
        assert await gateway_engine.inspect(cached_of_acme) == 0
        # The other tenant's copy of the same prompt still hits.
        again = await client.post("/v1/completions", json=body, headers=bearer(globex))
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * block


@pytest.mark.asyncio
async def test_a_tenants_weight_is_set_changed_and_carried_to_the_engine(
    gateway_engine: AsyncEngine, tmp_path: Path
) -> None:
    settings = settings_for(tmp_path, sqlite(tmp_path))
    async with serving(make_gateway(gateway_engine, settings)) as client:
        created = await client.post("/admin/api/tenants", json={"name": "heavy", "weight": 3}, headers=ADMIN)
        assert created.status_code == 201 and created.json()["weight"] == 3.0
        plain = await client.post("/admin/api/tenants", json={"name": "plain"}, headers=ADMIN)
        assert plain.json()["weight"] == 1.0
        for bad in (0, -1, 1001, None, "2", True):
            refused = await client.post(
                "/admin/api/tenants", json={"name": "bad", "weight": bad}, headers=ADMIN
            )
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "weight", (
                bad,
                refused.text,
            )
            patched = await client.patch("/admin/api/tenants/plain", json={"weight": bad}, headers=ADMIN)
            assert patched.status_code == 400 and patched.json()["error"]["param"] == "weight", (
                bad,
                patched.text,
            )
        patched = await client.patch("/admin/api/tenants/heavy", json={"weight": 0.5}, headers=ADMIN)
        assert patched.status_code == 200 and patched.json()["weight"] == 0.5
        assert (await client.get("/admin/api/tenants/heavy", headers=ADMIN)).json()["weight"] == 0.5

        # The next request carries the new weight into the engine's fair-share policy.
        key = await Admin(client).key("heavy")
        done = await client.post("/v1/completions", json=completion_body(BASE), headers=bearer(key))
        assert done.is_success, done.text
        weights = {tid.split(":")[1]: w for tid, w in gateway_engine.stats.tenant_weights.items() if tid}
        assert weights["heavy"] == 0.5
