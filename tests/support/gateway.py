"""The gateway in tests: the tiny LoRA-enabled engine, settings, an ASGI client, the admin API.

Fixtures (a pytest plugin, listed in ``pytest_plugins`` of tests/conftest.py):

    gateway_engine      module: an AsyncEngine on the tiny GQA model with LoRA enabled (rank <= 8)
    peft_adapter_dir    module: a PEFT LoRA saved by ``peft`` for that model (q_proj, v_proj, r=4)

serving(app)        runs the app's lifespan and gives an httpx client over ASGI
Admin               the admin API: tenants with quotas, keys
"""

from __future__ import annotations

import io
import tarfile
import zipfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:  # the gateway is imported when used: every test session loads this plugin
    from fastapi import FastAPI

    from loraplex.platform.engine.async_engine import AsyncEngine
    from loraplex.platform.settings import ServerSettings

ADMIN_TOKEN = "admin-token-for-tests-0123456789"
BASE = "tiny"
MAX_LORA_RANK = 8
ADAPTER_SPEC: dict[str, Any] = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def gateway_engine(tiny_dirs: dict[str, Path]) -> Iterator[AsyncEngine]:
    from loraplex.platform.engine.async_engine import AsyncEngine
    from support.engines import tiny_engine

    engine = AsyncEngine(
        tiny_engine(tiny_dirs, num_kv_blocks=128, enable_lora=True, max_lora_rank=MAX_LORA_RANK, max_loras=2)
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def peft_adapter_dir(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    from support.adapters import make_peft_adapter

    out = tmp_path_factory.mktemp("peft") / "adapter"
    make_peft_adapter(tiny_dirs["gqa_tied"], out, seed=7, spec=ADAPTER_SPEC)
    return out


def settings_for(
    tmp_path: Path, database_url: str, redis_url: str | None = None, **kw: Any
) -> ServerSettings:
    """Settings of a test gateway: its own store under ``tmp_path``, the admin token above."""
    from loraplex.platform.settings import ServerSettings

    values: dict[str, Any] = dict(
        data_dir=tmp_path / "data",
        adapter_store=tmp_path / "store",
        database_url=database_url,
        redis_url=redis_url,
        admin_token=ADMIN_TOKEN,
        served_model_name=BASE,
    )
    values.update(kw)
    return ServerSettings(**values)


def make_gateway(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    from loraplex.cli.server_app import build_server_app

    return build_server_app(engine, settings)


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app started (lifespan) behind an httpx client that speaks ASGI to it."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=120) as client:
            yield client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


ADMIN = bearer(ADMIN_TOKEN)


class Admin:
    """The admin API over one client."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def tenant(self, name: str, **quotas: int | None) -> dict[str, Any]:
        r = await self.client.post("/admin/api/tenants", json={"name": name, **quotas}, headers=ADMIN)
        assert r.status_code == 201, r.text
        return dict(r.json())

    async def key(self, tenant: str, **body: Any) -> str:
        r = await self.client.post(f"/admin/api/tenants/{tenant}/keys", json=body, headers=ADMIN)
        assert r.status_code == 201, r.text
        return str(r.json()["key"])

    async def tenant_with_key(self, name: str, **quotas: int | None) -> str:
        await self.tenant(name, **quotas)
        return await self.key(name)


def zip_bytes(folder: Path, prefix: str = "") -> bytes:
    """The adapter folder as a .zip (``prefix``: a folder inside the archive)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for path in sorted(folder.iterdir()):
            zf.write(path, prefix + path.name)
    return buf.getvalue()


def tar_gz_bytes(members: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tf.addfile(info)
    return buf.getvalue()


async def upload(
    client: httpx.AsyncClient,
    key: str,
    name: str,
    archive: bytes,
    visibility: str = "private",
    filename: str = "adapter.zip",
) -> httpx.Response:
    return await client.post(
        "/v1/adapters",
        data={"name": name, "visibility": visibility},
        files={"file": (filename, archive, "application/octet-stream")},
        headers=bearer(key),
    )


def completion_body(model: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True, **kw}
