"""Hostile adapter uploads: each is refused with the rule it broke, and leaves nothing behind.

After every refusal: no database row, no version folder and no staging folder in the store, and
no file anywhere else under the test's folder that the upload could have planted.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from support.adapters import make_small_adapter
from support.gateway import (
    Admin,
    bearer,
    make_gateway,
    serving,
    settings_for,
    tar_gz_bytes,
    upload,
    zip_bytes,
)

from loraplex.platform.engine.async_engine import AsyncEngine

MAX_UPLOAD_BYTES = 256 * 1024


@dataclass
class Uploads:
    client: httpx.AsyncClient
    key: str
    root: Path
    store: Path
    app: Any

    def planted(self) -> list[str]:
        """Files the attacks try to create, wherever they landed."""
        return sorted(str(p) for p in self.root.rglob("*") if "evil" in p.name or "pwned" in p.name)

    async def assert_nothing_stored(self) -> None:
        assert sorted(p.name for p in self.store.iterdir()) == [], "the store kept files"
        listed = await self.client.get("/v1/adapters", headers=bearer(self.key))
        assert listed.json()["data"] == []
        assert self.planted() == []

    async def refused(self, response: httpx.Response, status: int, code: str) -> dict[str, Any]:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["code"] == code, error
        assert str(self.root) not in error["message"], "the message leaks a server path"
        await self.assert_nothing_stored()
        return dict(error)


@pytest_asyncio.fixture
async def uploads(gateway_engine: AsyncEngine, tmp_path: Path) -> AsyncIterator[Uploads]:
    settings = settings_for(
        tmp_path, f"sqlite+aiosqlite:///{tmp_path / 'g.db'}", max_upload_bytes=MAX_UPLOAD_BYTES
    )
    app = make_gateway(gateway_engine, settings)
    async with serving(app) as client:
        key = await Admin(client).tenant_with_key("acme")
        yield Uploads(client, key, tmp_path, settings.gateway.adapter_store_dir, app)


def adapter_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def zip_of(members: dict[str, bytes], symlinks: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        for name, target in (symlinks or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o120777 << 16) | 0x20  # S_IFLNK: what `zip --symlinks` writes
            zf.writestr(info, target)
    return buf.getvalue()


class _Pwn:
    """Unpickling this would create a file: proof that a pickle was (or was not) loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, ...]]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.asyncio
async def test_zip_slip_and_absolute_paths(uploads: Uploads, peft_adapter_dir: Path) -> None:
    files = adapter_files(peft_adapter_dir)
    slip = await upload(uploads.client, uploads.key, "a", zip_of({**files, "../../evil.txt": b"x"}))
    error = await uploads.refused(slip, 400, "unsafe_archive")
    assert "path traversal" in error["message"]
    absolute = await upload(uploads.client, uploads.key, "a", zip_of({**files, "/tmp/evil-abs.txt": b"x"}))
    assert "absolute path" in (await uploads.refused(absolute, 400, "unsafe_archive"))["message"]
    tar_slip = tar_gz_bytes({**files, "adapter/../../evil.txt": b"x"})
    await uploads.refused(
        await upload(uploads.client, uploads.key, "a", tar_slip, filename="a.tar.gz"), 400, "unsafe_archive"
    )
    assert not Path("/tmp/evil-abs.txt").exists()


@pytest.mark.asyncio
async def test_symlinks(uploads: Uploads, peft_adapter_dir: Path) -> None:
    config = (peft_adapter_dir / "adapter_config.json").read_bytes()
    tar_link = tar_gz_bytes(
        {"adapter_config.json": config}, links={"adapter_model.safetensors": "/etc/passwd"}
    )
    error = await uploads.refused(
        await upload(uploads.client, uploads.key, "a", tar_link), 400, "unsafe_archive"
    )
    assert "link" in error["message"]
    zip_link = zip_of({"adapter_config.json": config}, symlinks={"adapter_model.safetensors": "/etc/passwd"})
    await uploads.refused(await upload(uploads.client, uploads.key, "a", zip_link), 400, "unsafe_archive")


@pytest.mark.asyncio
async def test_archive_bombs(uploads: Uploads, peft_adapter_dir: Path) -> None:
    files = adapter_files(peft_adapter_dir)
    # 64 MiB of zeros compress to well under the upload cap; no valid adapter of this model is that big.
    zeros = b"\0" * (64 << 20)
    bomb = zip_of({**files, "adapter_model.safetensors": zeros})
    assert len(bomb) < MAX_UPLOAD_BYTES
    error = await uploads.refused(
        await upload(uploads.client, uploads.key, "a", bomb), 400, "archive_too_large"
    )
    assert str(64 << 20) in error["message"]
    tar_bomb = tar_gz_bytes({**files, "padding.bin": zeros})
    await uploads.refused(
        await upload(uploads.client, uploads.key, "a", tar_bomb, filename="a.tgz"), 400, "archive_too_large"
    )
    many = zip_of({**files, **{f"f{i}.txt": b"" for i in range(500)}})
    await uploads.refused(await upload(uploads.client, uploads.key, "a", many), 400, "archive_too_large")


@pytest.mark.asyncio
async def test_pickles_are_refused_and_never_loaded(uploads: Uploads, peft_adapter_dir: Path) -> None:
    marker = uploads.root / "pwned"
    payload = pickle.dumps(_Pwn(marker))
    config = (peft_adapter_dir / "adapter_config.json").read_bytes()
    in_zip = zip_of({"adapter_config.json": config, "adapter_model.bin": payload})
    error = await uploads.refused(
        await upload(uploads.client, uploads.key, "a", in_zip), 400, "pickle_format"
    )
    assert "never loaded" in error["message"]
    bare = await upload(uploads.client, uploads.key, "a", payload, filename="adapter_model.bin")
    await uploads.refused(bare, 400, "pickle_format")
    two_files = await uploads.client.post(
        "/v1/adapters",
        data={"name": "a"},
        files={
            "adapter_config": ("adapter_config.json", config),
            "adapter_model": ("adapter_model.bin", payload),
        },
        headers=bearer(uploads.key),
    )
    await uploads.refused(two_files, 400, "pickle_format")
    # A pickle under the safetensors name is not safetensors: refused as such, still not loaded.
    disguised = zip_of({"adapter_config.json": config, "adapter_model.safetensors": payload})
    await uploads.refused(await upload(uploads.client, uploads.key, "a", disguised), 400, "bad_weights")
    assert not marker.exists()


@pytest.mark.asyncio
async def test_wrong_base_model_and_rank_over_the_limit(
    uploads: Uploads, tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    other_model = make_small_adapter(tiny_dirs["gqa3_bias"], tmp_path / "other", rank=4)  # hidden 96, not 64
    wrong = await upload(uploads.client, uploads.key, "a", zip_bytes(other_model))
    error = await uploads.refused(wrong, 400, "shape_mismatch")
    assert "do not fit the base model" in error["message"]
    big_rank = make_small_adapter(tiny_dirs["gqa_tied"], tmp_path / "big", rank=16)
    error = await uploads.refused(
        await upload(uploads.client, uploads.key, "a", zip_bytes(big_rank)), 400, "rank_too_large"
    )
    assert "max_lora_rank 8" in error["message"]


@pytest.mark.asyncio
async def test_body_over_the_cap(uploads: Uploads) -> None:
    big = os.urandom(MAX_UPLOAD_BYTES + 4096)
    declared = await upload(uploads.client, uploads.key, "a", big)  # counted as it streams
    await uploads.refused(declared, 413, "upload_too_large")

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked, and far over every limit
        boundary = b"--b0undary"
        yield boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="a.zip"\r\n\r\n'
        for _ in range(64):
            yield os.urandom(64 * 1024)

    chunked = await uploads.client.post(
        "/v1/adapters",
        content=chunks(),
        headers={**bearer(uploads.key), "Content-Type": "multipart/form-data; boundary=b0undary"},
    )
    await uploads.refused(chunked, 413, "upload_too_large")


def _multipart(parts: list[tuple[str, str | None, bytes]], boundary: str = "b0undary") -> bytes:
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


async def _asgi_post(
    app: Any, key: str, body_chunks: list[bytes], then_disconnect: bool
) -> list[dict[str, Any]]:
    """POST /v1/adapters straight to the ASGI app: the chunks, then a disconnect (the client left)
    or the end of the body; returns what the app sent."""
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": chunk, "more_body": then_disconnect or i < len(body_chunks) - 1}
        for i, chunk in enumerate(body_chunks)
    ]
    if then_disconnect:
        messages.append({"type": "http.disconnect"})
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    total = sum(map(len, body_chunks)) * 2  # the Content-Length the client promised
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/adapters",
        "raw_path": b"/v1/adapters",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"gateway"),
            (b"authorization", f"Bearer {key}".encode()),
            (b"content-type", b"multipart/form-data; boundary=b0undary"),
            (b"content-length", str(total).encode()),
        ],
        "client": ("127.0.0.1", 1234),
        "server": ("gateway", 80),
    }
    await app(scope, receive, send)
    return sent


@pytest.mark.asyncio
async def test_half_sent_uploads(uploads: Uploads, peft_adapter_dir: Path) -> None:
    body = _multipart([("name", None, b"a"), ("file", "a.zip", zip_bytes(peft_adapter_dir))])
    # The client sends half of the body, then goes away.
    await _asgi_post(uploads.app, uploads.key, [body[: len(body) // 2]], then_disconnect=True)
    await uploads.assert_nothing_stored()
    # The body ends (as far as HTTP knows) but the multipart stops before its closing boundary.
    sent = await _asgi_post(uploads.app, uploads.key, [body[: len(body) - 40]], then_disconnect=False)
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 400
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert json.loads(payload)["error"]["code"] == "incomplete_upload"
    await uploads.assert_nothing_stored()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_quota_refusal_after_validation_leaves_nothing(
    uploads: Uploads, peft_adapter_dir: Path, tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    admin = {"Authorization": "Bearer admin-token-for-tests-0123456789"}
    await uploads.client.patch("/admin/api/tenants/acme", json={"max_adapters": 1}, headers=admin)
    first = await upload(uploads.client, uploads.key, "one", zip_bytes(peft_adapter_dir))
    assert first.status_code == 201
    kept = sorted(p.name for p in uploads.store.iterdir())
    other = make_small_adapter(tiny_dirs["gqa_tied"], tmp_path / "other", rank=4)
    second = await upload(uploads.client, uploads.key, "two", zip_bytes(other))
    assert second.status_code == 403 and second.json()["error"]["code"] == "quota_exceeded"
    assert sorted(p.name for p in uploads.store.iterdir()) == kept
    await uploads.client.patch(
        "/admin/api/tenants/acme", json={"max_adapters": None, "max_adapter_bytes": 100}, headers=admin
    )
    third = await upload(uploads.client, uploads.key, "two", zip_bytes(other))
    assert third.status_code == 413 and third.json()["error"]["param"] == "max_adapter_bytes"
    assert sorted(p.name for p in uploads.store.iterdir()) == kept
    names = [
        a["name"]
        for a in (await uploads.client.get("/v1/adapters", headers=bearer(uploads.key))).json()["data"]
    ]
    assert names == ["one"]
