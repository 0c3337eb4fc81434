"""A hostile tenant cannot stall the gateway for the others, crash it, or leave files behind.

Each test runs one class of attack while a watcher polls ``/health`` and another tenant's
completion: both must keep answering in under a second (``Watch``). The gateway runs in this
test's event loop (ASGI), so anything that holds the GIL or the loop shows up as a slow answer.
"""

from __future__ import annotations

import asyncio
import bz2
import io
import json
import os
import struct
import tarfile
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from support.adapters import make_small_adapter
from support.gateway import (
    ADMIN,
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

STALL_S = 1.0
"""Longest a bystander's answer may take while an attack runs (the machine is loaded: generous)."""


@dataclass
class Watch:
    """Polls /health and a bystander's completion while an attack runs; records the slowest."""

    client: httpx.AsyncClient
    bystander_key: str
    worst_s: dict[str, float] = field(default_factory=lambda: {"health": 0.0, "completion": 0.0})

    async def _poll(self, what: str, call: Any, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            response = await call()
            assert response.status_code == 200, response.text
            self.worst_s[what] = max(self.worst_s[what], time.monotonic() - started)
            await asyncio.sleep(0.02)

    async def during(self, attack: Awaitable[Any]) -> Any:
        stop = asyncio.Event()
        pollers = [
            asyncio.ensure_future(self._poll("health", lambda: self.client.get("/health"), stop)),
            asyncio.ensure_future(
                self._poll(
                    "completion",
                    lambda: self.client.post(
                        "/v1/completions",
                        json=completion_body("tiny", max_tokens=1),
                        headers=bearer(self.bystander_key),
                    ),
                    stop,
                )
            ),
        ]
        await asyncio.sleep(0.1)  # the pollers run before the attack starts
        try:
            return await attack
        finally:
            stop.set()
            await asyncio.gather(*pollers)

    def assert_responsive(self) -> None:
        assert self.worst_s["health"] < STALL_S, self.worst_s
        assert self.worst_s["completion"] < STALL_S, self.worst_s


@dataclass
class Hostile:
    client: httpx.AsyncClient
    key: str
    app: Any
    store: Path
    watch: Watch

    def files_in_store(self) -> list[str]:
        return sorted(p.name for p in self.store.iterdir())


@pytest_asyncio.fixture
async def hostile(gateway_engine: AsyncEngine, tmp_path: Path) -> AsyncIterator[Hostile]:
    settings = settings_for(
        tmp_path,
        f"sqlite+aiosqlite:///{tmp_path / 'g.db'}",
        upload_idle_timeout_s=0.5,
        max_upload_bytes=64 << 20,  # room for the bombs: the limits under test are the archive's
    )
    app = make_gateway(gateway_engine, settings)
    async with serving(app) as client:
        admin = Admin(client)
        key = await admin.tenant_with_key("mallory")
        bystander = await admin.tenant_with_key("alice")
        # Warm up the bystander's path (first request compiles and allocates).
        warm = await client.post("/v1/completions", json=completion_body("tiny"), headers=bearer(bystander))
        assert warm.status_code == 200, warm.text
        yield Hostile(client, key, app, settings.gateway.adapter_store_dir, Watch(client, bystander))


def adapter_with_config(base: Path, out: Path, **config: Any) -> Path:
    folder = make_small_adapter(base, out)
    values = json.loads((folder / "adapter_config.json").read_text())
    values.update(config)
    (folder / "adapter_config.json").write_text(json.dumps(values))
    return folder


# -- 1: patterns from a config ------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.asyncio
async def test_backtracking_patterns_do_not_stall_the_gateway(
    hostile: Hostile, tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    # Exponential for a backtracking matcher on a module name (~2^24 steps per name).
    pattern = "(?:.|.){0,24}!"
    folder = adapter_with_config(tiny_dirs["gqa_tied"], tmp_path / "a", rank_pattern={pattern: 4})
    answer = await hostile.watch.during(upload(hostile.client, hostile.key, "evil", zip_bytes(folder)))
    assert answer.status_code == 201, answer.text
    # First use: the engine loads it (the same patterns, matched again at most from a cache).
    used = await hostile.watch.during(
        hostile.client.post("/v1/completions", json=completion_body("evil"), headers=bearer(hostile.key))
    )
    assert used.status_code == 200, used.text
    hostile.watch.assert_responsive()

    # What needs backtracking is refused with the reason, at upload.
    folder = adapter_with_config(tiny_dirs["gqa_tied"], tmp_path / "b", rank_pattern={r"(q)\1": 4})
    refused = await upload(hostile.client, hostile.key, "evil2", zip_bytes(folder))
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "bad_config"
    assert "backreferences" in refused.json()["error"]["message"]


# -- 2: archive bombs ---------------------------------------------------------------------
def tar_bz2_bomb(declared: int = 1 << 30) -> bytes:
    """A small .tar.bz2 whose one member declares (and holds) ``declared`` zero bytes: one bz2
    stream per MiB of zeros, concatenated (bz2 readers read every stream)."""
    header = tarfile.TarInfo("adapter_model.safetensors")
    header.size = declared
    mib_of_zeros = bz2.compress(bytes(1 << 20), 9)
    return bz2.compress(header.tobuf(format=tarfile.GNU_FORMAT), 9) + mib_of_zeros * (declared >> 20)


def zip_of_empty_entries(count: int) -> bytes:
    """A .zip of ``count`` empty stored files, written directly (zipfile takes seconds for 300k)."""
    local, central = io.BytesIO(), io.BytesIO()
    for i in range(count):
        name = f"{i}".encode()
        offset = local.tell()
        local.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, 0, 0, 0, len(name), 0) + name)
        central.write(
            struct.pack(
                "<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, 0, 0, 0, len(name), 0, 0, 0, 0, 0, offset
            )
            + name
        )
    cd = central.getvalue()
    end = struct.pack(
        "<4s4H2LH", b"PK\x05\x06", 0, 0, min(count, 0xFFFF), min(count, 0xFFFF), len(cd), local.tell(), 0
    )
    return local.getvalue() + cd + end


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    return {"bomb.tar.bz2": tar_bz2_bomb(), "many.zip": zip_of_empty_entries(300_000)}


@pytest.mark.slow
@pytest.mark.asyncio
async def test_archive_bombs_are_refused_quickly_without_stalling_others(
    hostile: Hostile, bombs: dict[str, bytes]
) -> None:
    admin = Admin(hostile.client)
    keys = [hostile.key] + [await admin.tenant_with_key(f"bomber{i}") for i in range(5)]

    async def one(key: str, filename: str) -> tuple[httpx.Response, float]:
        started = time.monotonic()
        answer = await upload(hostile.client, key, "bomb", bombs[filename], filename=filename)
        return answer, time.monotonic() - started

    for filename in bombs:
        answers = await hostile.watch.during(asyncio.gather(*(one(k, filename) for k in keys)))
        for answer, took_s in answers:
            assert answer.status_code == 400 and answer.json()["error"]["code"] == "archive_too_large", (
                answer.text
            )
            assert took_s < 1.5, (filename, took_s)
    hostile.watch.assert_responsive()
    assert hostile.files_in_store() == []


# -- 4: quota admission before any work; uploads under quota ------------------------------
@pytest.mark.asyncio
async def test_a_request_over_rpm_is_refused_before_rendering(hostile: Hostile) -> None:
    admin = Admin(hostile.client)
    key = await admin.tenant_with_key("hasty", rpm=1)
    first = await hostile.client.post("/v1/completions", json=completion_body("tiny"), headers=bearer(key))
    assert first.status_code == 200
    huge = "the quick brown fox " * 50_000  # 1M characters: about a second to template and tokenize
    body = {"model": "tiny", "messages": [{"role": "user", "content": huge}], "max_tokens": 1}

    async def refused_many() -> list[float]:
        took = []
        for _ in range(5):
            started = time.monotonic()
            over = await hostile.client.post("/v1/chat/completions", json=body, headers=bearer(key))
            took.append(time.monotonic() - started)
            assert over.status_code == 429, over.text
        return took

    took = await hostile.watch.during(refused_many())
    assert max(took) < 0.4, took  # a refusal costs parsing the body, not templating it
    hostile.watch.assert_responsive()
    gateway = hostile.app.state.loraplex.gateway
    assert gateway.stats().num_quota_refusals == 5
    await asyncio.sleep(0.2)
    usage = (await hostile.client.get("/admin/api/usage?tenant=hasty", headers=ADMIN)).json()
    assert usage["num_requests"] == 1, "a refusal wrote a usage row"


@pytest.mark.asyncio
async def test_uploads_count_against_rpm_and_have_their_own_concurrency(
    hostile: Hostile, tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    admin = Admin(hostile.client)
    key = await admin.tenant_with_key("uploader", rpm=1)
    archive = zip_bytes(make_small_adapter(tiny_dirs["gqa_tied"], tmp_path / "a"))
    assert (await upload(hostile.client, key, "one", archive)).status_code == 201
    over = await upload(hostile.client, key, "two", archive)
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded", over.text


@pytest.mark.slow
@pytest.mark.asyncio
async def test_stalled_uploads_time_out_and_are_capped_per_tenant(hostile: Hostile) -> None:
    async def stalled() -> AsyncIterator[bytes]:
        yield b'--x\r\nContent-Disposition: form-data; name="file"; filename="a.zip"\r\n\r\n' + bytes(1024)
        await asyncio.sleep(20)

    headers = {**bearer(hostile.key), "Content-Type": "multipart/form-data; boundary=x"}
    started = time.monotonic()
    slow = [
        asyncio.ensure_future(hostile.client.post("/v1/adapters", content=stalled(), headers=headers))
        for _ in range(2)
    ]
    await asyncio.sleep(0.1)
    # Uploads in flight per tenant (max_uploads_per_tenant=2): the third is refused before its body.
    third = await hostile.client.post("/v1/adapters", content=stalled(), headers=headers)
    assert third.status_code == 429 and third.json()["error"]["code"] == "too_many_uploads", third.text
    # -- 7: the stalled ones time out (upload_idle_timeout_s=0.5) and leave nothing.
    for answer in await asyncio.gather(*slow):
        assert answer.status_code == 408 and answer.json()["error"]["code"] == "upload_timeout", answer.text
    assert time.monotonic() - started < 10
    assert [p for p in hostile.files_in_store() if p.startswith(".staging")] == []


# -- 5 and 6: request bodies --------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_large_structured_body_does_not_stall_the_gateway(hostile: Hostile) -> None:
    ignored = ",".join(["0"] * 3_900_000)
    raw = (
        '{"model": "tiny", "prompt": [1, 2], "max_tokens": 1, "user": "x", "junk": [' + ignored + "]}"
    ).encode()
    answer = await hostile.watch.during(
        hostile.client.post(
            "/v1/completions",
            content=raw,
            headers={**bearer(hostile.key), "Content-Type": "application/json"},
        )
    )
    assert answer.status_code in (200, 400), answer.text
    hostile.watch.assert_responsive()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", '{"model": "tiny", "prompt": "hi", "max_tokens": %s}'),
        ("/v1/completions", '{"model": "tiny", "prompt": [%s]}'),
        ("/v1/completions", '{"model": "tiny", "prompt": "hi", "seed": %s}'),
        ("/v1/chat/completions", '{"model": "tiny", "messages": [], "temperature": %s}'),
        ("/v1/completions", '{"model": "tiny", "prompt": "hi", "junk": %s}'),
    ],
)
async def test_huge_integers_are_a_400(hostile: Hostile, path: str, body: str) -> None:
    for number in ("9" * 5000, "1e999", "9" * 4000, "-" + "9" * 300):
        answer = await hostile.client.post(
            path,
            content=(body % number).encode(),
            headers={**bearer(hostile.key), "Content-Type": "application/json"},
        )
        assert answer.status_code in (400, 200), (number[:10], answer.text)
        if number == "9" * 5000:
            assert answer.status_code == 400 and "too many digits" in answer.text


@pytest.mark.asyncio
async def test_huge_integers_on_the_admin_api_are_a_400(hostile: Hostile) -> None:
    answer = await hostile.client.post(
        "/admin/api/tenants",
        content=('{"name": "n", "rpm": ' + "9" * 5000 + "}").encode(),
        headers={**ADMIN, "Content-Type": "application/json"},
    )
    assert answer.status_code == 400, answer.text


# -- 3: deleting what this process never loaded; the start-up sweep ------------------------
@pytest.mark.asyncio
async def test_deleting_never_loaded_adapters_and_their_tenant_after_a_restart(
    gateway_engine: AsyncEngine, tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    settings = settings_for(tmp_path, f"sqlite+aiosqlite:///{tmp_path / 'g.db'}")
    store = settings.gateway.adapter_store_dir
    archive = zip_bytes(make_small_adapter(tiny_dirs["gqa_tied"], tmp_path / "a"))
    other = zip_bytes(make_small_adapter(tiny_dirs["gqa_tied"], tmp_path / "b", seed=1))
    async with serving(make_gateway(gateway_engine, settings)) as client:
        admin = Admin(client)
        key = await admin.tenant_with_key("acme")
        await admin.tenant_with_key("gone")
        gone_key = await admin.key("gone")
        assert (await upload(client, key, "fr", archive)).status_code == 201
        assert (await upload(client, gone_key, "de", other)).status_code == 201
        # The store's files are private to the server's user.
        versions = [p for p in store.iterdir() if not p.name.startswith(".")]
        assert store.stat().st_mode & 0o777 == 0o700
        for version in versions:
            assert version.stat().st_mode & 0o777 == 0o700
            assert {f.stat().st_mode & 0o777 for f in version.iterdir()} == {0o600}
        assert (tmp_path / "g.db").stat().st_mode & 0o777 == 0o600
    # A version folder nobody references (a deletion interrupted in an older release), an hour old.
    orphan = store / ("0" * 64)
    orphan.mkdir()
    (orphan / "adapter_config.json").write_text("{}")
    os.utime(orphan, (time.time() - 7200, time.time() - 7200))

    async with serving(make_gateway(gateway_engine, settings)) as client:  # a restart: nothing loaded
        assert not orphan.exists(), "the start-up sweep kept an unreferenced version"
        deleted = await client.delete("/v1/adapters/fr", headers=bearer(key))
        assert deleted.status_code == 200, deleted.text
        gone = await client.delete("/admin/api/tenants/gone", headers=ADMIN)
        assert gone.status_code == 200 and gone.json()["adapters_removed"] == 1, gone.text
        assert sorted(p.name for p in store.iterdir()) == []


# -- 8: a deleted or disabled tenant's running requests end; shutdown leaves no copies -----
@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["delete", "disable"])
async def test_a_removed_tenants_stream_ends_with_an_error_event(hostile: Hostile, how: str) -> None:
    gate = hostile.app.state.loraplex.gateway.gate
    body = completion_body("tiny", max_tokens=1500, stream=True)  # long: it cannot end first

    async def stream() -> httpx.Response:
        return await hostile.client.post("/v1/completions", json=body, headers=bearer(hostile.key))

    running = asyncio.ensure_future(stream())
    deadline = time.monotonic() + 30
    while not any(a.streams for live in gate.running.values() for a in live):
        assert time.monotonic() < deadline and not running.done(), "the request never started"
        await asyncio.sleep(0.005)
    if how == "delete":
        removed = await hostile.client.delete("/admin/api/tenants/mallory", headers=ADMIN)
    else:
        removed = await hostile.client.patch(
            "/admin/api/tenants/mallory", json={"disabled": True}, headers=ADMIN
        )
    assert removed.status_code == 200, removed.text
    answer = await running
    events = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2]).get("error")
    assert error is not None and error["code"] == f"tenant_{how}d", events[-3:]
    assert len(events) < 1500, "the stream ran to its end"
    await asyncio.sleep(0.2)
    assert gate.running == {}
    assert hostile.app.state.loraplex.gateway.stats().num_background_failed == 0


def test_engine_shutdown_removes_its_adapter_copies(
    tiny_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    from loraplex.adapters import LoRARequest
    from loraplex.platform.engine.config import EngineConfig
    from loraplex.platform.engine.engine import LLMEngine

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    folder = make_small_adapter(tiny_dirs["gqa_tied"], tmp_path / "a")
    config = EngineConfig(
        model=str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=32, enable_lora=True, max_lora_rank=8
    )
    engine = AsyncEngine(LLMEngine(config))
    try:
        asyncio.run(engine.add_lora(LoRARequest("a", 1, str(folder)), "acme"))
        assert [p.name for p in temp.iterdir() if p.name.startswith("loraplex-adapters-")] != []
    finally:
        engine.shutdown()
    assert [p.name for p in temp.iterdir() if p.name.startswith("loraplex-adapters-")] == []


# -- 9: names and visibility ---------------------------------------------------------------
@pytest.mark.asyncio
async def test_the_served_models_name_is_refused_and_reuploads_keep_visibility(
    hostile: Hostile, tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    first = zip_bytes(make_small_adapter(tiny_dirs["gqa_tied"], tmp_path / "a"))
    second = zip_bytes(make_small_adapter(tiny_dirs["gqa_tied"], tmp_path / "b", seed=1))
    clash = await upload(hostile.client, hostile.key, "tiny", first)
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "name", clash.text
    assert (await upload(hostile.client, hostile.key, "fr", first, visibility="public")).status_code == 201
    again = await hostile.client.post(
        "/v1/adapters",
        data={"name": "fr"},
        files={"file": ("a.zip", second, "application/zip")},
        headers=bearer(hostile.key),
    )
    assert again.status_code == 201 and again.json()["visibility"] == "public", again.text
    assert hostile.files_in_store() != []


# -- 10: open mode -------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_open_mode_answers_only_local_callers_without_keys(
    gateway_engine: AsyncEngine, tmp_path: Path
) -> None:
    settings = settings_for(
        tmp_path, f"sqlite+aiosqlite:///{tmp_path / 'g.db'}", auth="open", host="127.0.0.1"
    )
    async with serving(make_gateway(gateway_engine, settings)) as client:
        client.base_url = httpx.URL("http://127.0.0.1:8000")
        body = completion_body("tiny", max_tokens=1)
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        as_local = await client.post("/v1/completions", json=body, headers=bearer("local"))
        assert as_local.status_code == 200
        # A key sent to a server that ignores keys: refused, not silently run as 'local'.
        keyed = await client.post("/v1/completions", json=body, headers=bearer("sk-some-real-looking-key"))
        assert keyed.status_code == 401 and "open mode" in keyed.json()["error"]["message"]
        # What a cross-site page can send without a preflight: refused.
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {} if content_type is None else {"Content-Type": content_type}
            sent = await client.post("/v1/completions", content=json.dumps(body).encode(), headers=headers)
            assert sent.status_code == 415, (content_type, sent.text)
        cross = await client.post(
            "/v1/adapters",
            data={"name": "x"},
            files={"file": ("a.zip", b"PK", "application/zip")},
            headers={"Origin": "https://evil.example"},
        )
        assert cross.status_code == 403 and cross.json()["error"]["code"] == "cross_origin"
        # DNS rebinding: a foreign name resolving to 127.0.0.1.
        rebound = await client.get("/v1/models", headers={"Host": "evil.example:8000"})
        assert rebound.status_code == 421
        assert (await client.get("/health", headers={"Host": "localhost:8000"})).status_code == 200


# -- 11: exposure ----------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_api_docs_are_off_with_keys_and_secrets_are_never_echoed(
    hostile: Hostile, gateway_engine: AsyncEngine, tmp_path: Path
) -> None:
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert (await hostile.client.get(path)).status_code == 404, path
    settings = settings_for(tmp_path / "b", f"sqlite+aiosqlite:///{tmp_path / 'b.db'}", api_docs=True)
    async with serving(make_gateway(gateway_engine, settings)) as client:
        assert (await client.get("/openapi.json")).status_code == 200

    from pydantic import ValidationError

    from loraplex.platform.settings import ServerSettings
    from loraplex.platform.settings.loader import load_settings

    with pytest.raises(ValidationError) as info:
        ServerSettings(admin_token="tooshort-secret")
    assert "tooshort" not in str(info.value)
    with pytest.raises(ValidationError) as info:
        load_settings({"admin_token": "tooshort-secret"})
    assert "tooshort" not in str(info.value)


def test_admin_token_on_the_command_line_warns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraplex.cli import main

    monkeypatch.delenv("LORAPLEX_ADMIN_TOKEN", raising=False)
    assert main(["serve", "--print-settings", "--admin-token", "a-real-secret-of-some-length"]) == 0
    out, err = capsys.readouterr()
    assert "visible to every user" in err and "a-real-secret" not in out + err


# -- 12: one limit, one number -----------------------------------------------------------------
@pytest.mark.asyncio
async def test_both_upload_413s_quote_the_same_limit(hostile: Hostile) -> None:
    limit = hostile.app.state.loraplex.gateway.max_upload_bytes
    over_framing = await upload(hostile.client, hostile.key, "big", bytes(limit + (2 << 20)))  # middleware
    over_files = await upload(
        hostile.client, hostile.key, "big", bytes(limit + 1024)
    )  # counted as it streams
    for answer in (over_framing, over_files):
        assert answer.status_code == 413 and f"limit of {limit} bytes" in answer.json()["error"]["message"]


def test_cli_quota_errors_are_one_line_and_sizes_take_units(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraplex.cli import main

    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("LORAPLEX_DATABASE_URL", raising=False)
    assert main(["tenants", "create", "acme", "--rpm", "0"]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "--rpm" in err and "--help" in err, err
    assert main(["tenants", "create", "acme", "--database-url", "sqlite:///x.db"]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "goes before the subcommand" in err, err
    assert main(["tenants", "create", "acme", "--max-adapter-bytes", "10MiB"]) == 0
    assert main(["tenants", "list"]) == 0
    out, _ = capsys.readouterr()
    assert str(10 << 20) in out or "10MiB" in out, out
