"""The admin UI's locks: no session or a tenant's session reaches nothing it should not, forged
cross-site posts are refused, tenants stay inside their own data whatever they put in a path,
parameter or cursor, failed sign-ins are limited, and an upload over the cap stops early."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from support.admin_ui import csrf_of, ui_sign_in
from support.gateway import ADMIN, ADMIN_TOKEN, Admin, make_gateway, serving, settings_for, upload, zip_bytes

from loraplex.platform.api.services.pages import encode_cursor
from loraplex.platform.engine.async_engine import AsyncEngine

pytestmark = pytest.mark.asyncio

PAGES = [
    "/admin/dashboard",
    "/admin/tenants",
    "/admin/tenants/acme",
    "/admin/keys",
    "/admin/adapters",
    "/admin/adapters/acme/sql",
    "/admin/usage",
    "/admin/playground",
]
JSON_CALLS = [("GET", "/admin/ui/stats"), ("POST", "/admin/ui/adapters"), ("POST", "/admin/ui/completions")]
FORM_POSTS = [
    "/admin/tenants",
    "/admin/tenants/acme/quotas",
    "/admin/tenants/acme/state",
    "/admin/tenants/acme/delete",
    "/admin/tenants/acme/keys",
    "/admin/keys/1/revoke",
    "/admin/adapters/acme/sql/delete",
    "/admin/sign-out",
]
OPERATOR_ONLY = ["/admin/tenants", "/admin/tenants/acme", "/admin/tenants/beta"]
ADMIN_API = ["/admin/api/tenants", "/admin/api/tenants/acme/keys", "/admin/api/adapters", "/admin/api/usage"]


def sqlite(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"


async def _world(client: httpx.AsyncClient, adapter_dir: Path) -> dict[str, str]:
    """Tenants acme and beta with a key each and an adapter each (acme/sql, beta/secret)."""
    admin = Admin(client)
    keys = {"acme": await admin.tenant_with_key("acme"), "beta": await admin.tenant_with_key("beta")}
    assert (await upload(client, keys["acme"], "sql", zip_bytes(adapter_dir))).status_code == 201
    assert (await upload(client, keys["beta"], "secret", zip_bytes(adapter_dir))).status_code == 201
    return keys


@pytest.mark.slow
async def test_nothing_without_a_session(
    gateway_engine: AsyncEngine, tmp_path: Path, peft_adapter_dir: Path
) -> None:
    async with serving(make_gateway(gateway_engine, settings_for(tmp_path, sqlite(tmp_path)))) as client:
        await _world(client, peft_adapter_dir)
        for path in PAGES:
            r = await client.get(path)
            assert r.status_code == 303 and r.headers["location"] == "/admin", path
            assert "acme" not in r.text and "beta" not in r.text
        for method, path in JSON_CALLS:
            r = await client.request(method, path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "signed_out", path
        for path in FORM_POSTS:
            r = await client.post(path, data={"csrf_token": "x", "name": "evil"})
            assert r.status_code == 401, (path, r.status_code)
            # a browser's form (an expired session) is sent to the sign-in page instead
            r = await client.post(path, data={"csrf_token": "x"}, headers={"accept": "text/html"})
            assert r.status_code == 303 and r.headers["location"] == "/admin", path
        # a made-up session cookie is no session
        client.cookies.set("lpx_admin_session", "forged-session-token", domain="gateway", path="/admin")
        assert (await client.get("/admin/tenants")).status_code == 303
        assert (await client.get("/admin/api/tenants", headers=ADMIN)).json()["data"][0]["name"] == "acme"


async def test_a_tenant_sees_only_its_own(
    gateway_engine: AsyncEngine, tmp_path: Path, peft_adapter_dir: Path
) -> None:
    async with serving(make_gateway(gateway_engine, settings_for(tmp_path, sqlite(tmp_path)))) as client:
        keys = await _world(client, peft_adapter_dir)
        beta_cursor = encode_cursor(2)
        assert (await ui_sign_in(client, keys["acme"])).status_code == 303
        csrf = await csrf_of(client)
        for path in OPERATOR_ONLY:
            r = await client.get(path)
            assert r.status_code == 403 and "beta" not in r.text, path
        for path in ADMIN_API:  # the session cookie is not the admin token
            assert (await client.get(path)).status_code == 401, path
        mine = await client.get("/admin/adapters")
        assert "sql" in mine.text and "secret" not in mine.text and "beta" not in mine.text
        for path in [
            "/admin/adapters?tenant=beta",
            "/admin/adapters/beta/secret",
            "/admin/usage?tenant=beta",
            "/admin/playground?tenant=beta",
        ]:
            r = await client.get(path)
            assert r.status_code == 404 and "secret" not in r.text, path
        after = await client.get("/admin/adapters", params={"after": "a"})
        assert "secret" not in after.text
        assert (await client.get("/admin/adapters", params={"after": beta_cursor})).status_code in (200, 400)
        refused = await client.post(
            "/admin/adapters/beta/secret/delete", data={"csrf_token": csrf}, headers={"x-csrf-token": csrf}
        )
        assert refused.status_code == 404
        stolen = await client.post(
            "/admin/ui/adapters?tenant=beta",
            files={"file": ("a.zip", zip_bytes(peft_adapter_dir))},
            data={"name": "planted"},
            headers={"x-csrf-token": csrf},
        )
        assert stolen.status_code == 404
        ran = await client.post(
            "/admin/ui/completions?tenant=beta",
            json={"model": "secret", "prompt": [1, 2], "max_tokens": 1},
            headers={"x-csrf-token": csrf},
        )
        assert ran.status_code == 404
        # its own model by beta's name: not found like any private adapter of another tenant
        ran = await client.post(
            "/admin/ui/completions",
            json={"model": "beta/secret", "prompt": [1, 2], "max_tokens": 1},
            headers={"x-csrf-token": csrf},
        )
        assert ran.status_code == 404
        # the operator's forms, posted by a tenant with a valid CSRF token: 403, nothing changes
        beta_key_id = (await client.get("/admin/api/tenants/beta/keys", headers=ADMIN)).json()["data"][0][
            "id"
        ]
        for path in [
            "/admin/tenants",
            "/admin/tenants/beta/quotas",
            "/admin/tenants/beta/state",
            "/admin/tenants/beta/delete",
            "/admin/tenants/beta/keys",
            f"/admin/keys/{beta_key_id}/revoke",
        ]:
            r = await client.post(
                path, data={"csrf_token": csrf, "name": "x", "disabled": "1", "confirm_name": "beta"}
            )
            assert r.status_code == 403, (path, r.status_code)
        beta = (await client.get("/admin/api/tenants/beta", headers=ADMIN)).json()
        assert beta["disabled"] is False
        beta_keys = (await client.get("/admin/api/tenants/beta/keys", headers=ADMIN)).json()["data"]
        assert len(beta_keys) == 1 and beta_keys[0]["revoked_at"] is None
        stats = (await client.get("/admin/ui/stats")).json()
        assert "engine" not in stats and set(stats["tenants"]) <= {"acme"}
        beta_adapters = (await client.get("/admin/api/adapters?tenant=beta", headers=ADMIN)).json()["data"]
        assert [a["name"] for a in beta_adapters] == ["secret"]  # still there


async def test_forged_posts_are_refused(gateway_engine: AsyncEngine, tmp_path: Path) -> None:
    async with serving(make_gateway(gateway_engine, settings_for(tmp_path, sqlite(tmp_path)))) as client:
        assert (await ui_sign_in(client, ADMIN_TOKEN)).status_code == 303
        csrf = await csrf_of(client)
        # what another site's form could send: the cookie rides along (were it not SameSite), no token
        forged = await client.post("/admin/tenants", data={"name": "evil"})
        assert forged.status_code == 403 and forged.json()["error"]["code"] == "csrf_failed"
        wrong = await client.post("/admin/tenants", data={"name": "evil", "csrf_token": "guess"})
        assert wrong.status_code == 403
        cross = await client.post(
            "/admin/tenants",
            data={"name": "evil", "csrf_token": csrf},
            headers={"origin": "https://evil.example"},
        )
        assert cross.status_code == 403
        fetched = await client.post(
            "/admin/tenants",
            data={"name": "evil", "csrf_token": csrf},
            headers={"sec-fetch-site": "cross-site"},
        )
        assert fetched.status_code == 403
        assert (await client.get("/admin/api/tenants", headers=ADMIN)).json()["data"] == []
        made = await client.post(
            "/admin/tenants", data={"name": "good", "csrf_token": csrf}, headers={"origin": "http://gateway"}
        )
        assert made.status_code == 303
        # a forged sign-in (login CSRF) without the form's nonce does nothing
        client.cookies.clear()
        forged_signin = await client.post("/admin/sign-in", data={"credential": ADMIN_TOKEN})
        assert forged_signin.status_code == 403 and "lpx_admin_session" not in forged_signin.cookies


async def test_sessions_cookies_sign_out_and_revocation(gateway_engine: AsyncEngine, tmp_path: Path) -> None:
    async with serving(make_gateway(gateway_engine, settings_for(tmp_path, sqlite(tmp_path)))) as client:
        key = await Admin(client).tenant_with_key("acme")
        signed = await ui_sign_in(client, ADMIN_TOKEN)
        cookie = signed.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/admin" in cookie
        assert "Max-Age=28800" in cookie and "Secure" not in cookie  # plain http here
        token = signed.cookies["lpx_admin_session"]
        csrf = await csrf_of(client)
        out = await client.post("/admin/sign-out", data={"csrf_token": csrf})
        assert out.status_code == 303
        client.cookies.set("lpx_admin_session", token, domain="gateway", path="/admin")
        assert (await client.get("/admin/tenants")).status_code == 303  # revoked on the server
        client.cookies.clear()
        assert (await ui_sign_in(client, key)).status_code == 303
        assert (await client.get("/admin/keys")).status_code == 200
        key_id = (await client.get("/admin/api/tenants/acme/keys", headers=ADMIN)).json()["data"][0]["id"]
        assert (await client.delete(f"/admin/api/keys/{key_id}", headers=ADMIN)).status_code == 200
        assert (await client.get("/admin/keys")).status_code == 303  # the key's session ended with it
    https = httpx.ASGITransport(
        app=make_gateway(gateway_engine, settings_for(tmp_path / "s", sqlite(tmp_path / "s")))
    )
    app = https.app
    async with (
        app.router.lifespan_context(app),  # type: ignore[attr-defined]
        httpx.AsyncClient(transport=https, base_url="https://gateway") as secure,
    ):
        assert "Secure" in (await ui_sign_in(secure, ADMIN_TOKEN)).headers["set-cookie"]


async def test_failed_sign_ins_are_limited(gateway_engine: AsyncEngine, tmp_path: Path) -> None:
    settings = settings_for(tmp_path, sqlite(tmp_path), admin_signin_max_failures=3)
    async with serving(make_gateway(gateway_engine, settings)) as client:
        for _ in range(3):
            r = await ui_sign_in(client, "lpx-wrong-key")
            assert r.status_code == 401 and "neither the admin token nor a valid API key" in r.text
        limited = await ui_sign_in(client, ADMIN_TOKEN)  # even the right token waits now
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) > 0
        assert "lpx_admin_session" not in limited.cookies


async def test_an_upload_over_the_cap_stops_early(
    gateway_engine: AsyncEngine, tmp_path: Path, peft_adapter_dir: Path
) -> None:
    settings = settings_for(tmp_path, sqlite(tmp_path), max_upload_bytes=64 * 1024)
    async with serving(make_gateway(gateway_engine, settings)) as client:
        await Admin(client).tenant("acme")
        assert (await ui_sign_in(client, ADMIN_TOKEN)).status_code == 303
        csrf = await csrf_of(client)
        sent = 0

        async def body() -> object:
            nonlocal sent
            yield b'--b\r\nContent-Disposition: form-data; name="name"\r\n\r\nbig\r\n'
            yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.zip"\r\n\r\n'
            for _ in range(1024):  # 64 MiB offered
                sent += 65536
                yield b"\0" * 65536
            yield b"\r\n--b--\r\n"

        r = await client.post(
            "/admin/ui/adapters?tenant=acme",
            content=body(),  # type: ignore[arg-type]
            headers={"x-csrf-token": csrf, "content-type": "multipart/form-data; boundary=b"},
        )
        assert r.status_code == 413, r.text
        assert sent < 8 * 1024 * 1024  # refused after about the cap, not after the whole body
        store = tmp_path / "store"
        leftovers = [p for p in store.rglob("*") if p.is_file()]
        assert leftovers == [], leftovers
        assert (await client.get("/admin/api/adapters", headers=ADMIN)).json()["data"] == []


async def test_tenant_forms_set_the_fair_share_weight(gateway_engine: AsyncEngine, tmp_path: Path) -> None:
    async with serving(make_gateway(gateway_engine, settings_for(tmp_path, sqlite(tmp_path)))) as client:
        assert (await ui_sign_in(client, ADMIN_TOKEN)).status_code == 303
        csrf = await csrf_of(client)
        made = await client.post("/admin/tenants", data={"name": "heavy", "weight": "3", "csrf_token": csrf})
        assert made.status_code == 303
        plain = await client.post("/admin/tenants", data={"name": "plain", "csrf_token": csrf})
        assert plain.status_code == 303

        async def weight(name: str) -> float:
            r = await client.get(f"/admin/api/tenants/{name}", headers=ADMIN)
            return float(r.json()["weight"])

        assert await weight("heavy") == 3.0 and await weight("plain") == 1.0
        page = await client.get("/admin/tenants/heavy")
        assert 'name="weight"' in page.text and 'value="3"' in page.text
        saved = await client.post("/admin/tenants/heavy/quotas", data={"weight": "0.5", "csrf_token": csrf})
        assert saved.status_code == 303 and await weight("heavy") == 0.5
        bad = await client.post("/admin/tenants/heavy/quotas", data={"weight": "zero", "csrf_token": csrf})
        assert bad.status_code == 400 and "Fair-share weight: must be a number" in bad.text
        assert await weight("heavy") == 0.5
