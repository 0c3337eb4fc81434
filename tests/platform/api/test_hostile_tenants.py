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
from e2e.live_server import make_small_adapter
from gateway_testlib import (
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
