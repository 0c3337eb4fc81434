"""vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` on a real gateway (SQLite, the tiny
engine): the operator only; the adapter then listed with ``parent`` and served to every tenant by
its bare name (a tenant's own adapter of that name first); unload removes it; refusals as vLLM
answers them (status, ``type``, the status as ``code``, vLLM's messages).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.gateway import (
    ADAPTER_SPEC,
    ADMIN,
    BASE,
    Admin,
    bearer,
    gateway_engine,
    make_gateway,
    peft_adapter_dir,
    serving,
    settings_for,
    upload,
    zip_bytes,
)

from loraplex.platform.api.services import adapters, tenants
from loraplex.platform.api.state import app_state
from loraplex.platform.engine.async_engine import AsyncEngine

__all__ = ["gateway_engine", "peft_adapter_dir"]

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


async def greedy(client: httpx.AsyncClient, key: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    return await client.post("/v1/completions", json=body, headers=bearer(key))


def refusal(r: httpx.Response, status: int, err_type: str, text: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == err_type and error["code"] == status and text in error["message"], error
    return dict(error)


async def load(client: httpx.AsyncClient, headers: dict[str, str], **body: Any) -> httpx.Response:
    return await client.post("/v1/load_lora_adapter", json=body, headers=headers)


async def unload(client: httpx.AsyncClient, headers: dict[str, str], **body: Any) -> httpx.Response:
    return await client.post("/v1/unload_lora_adapter", json=body, headers=headers)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_load_list_serve_unload_and_refusals(
    gateway_engine: AsyncEngine, peft_adapter_dir: Path, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    from support.adapters import make_peft_adapter

    root = tmp_path / "loadable"
    shutil.copytree(peft_adapter_dir, root / "style")
    make_peft_adapter(tiny_dirs["gqa_tied"], root / "style-v2", seed=21, spec=ADAPTER_SPEC)
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    (root / "broken" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    outside = tmp_path / "outside"
    shutil.copytree(peft_adapter_dir, outside)
    (root / "escape").symlink_to(outside)

    settings = settings_for(tmp_path, f"sqlite+aiosqlite:///{tmp_path / 'g.db'}", lora_load_root=root)
    app = make_gateway(gateway_engine, settings)
    async with serving(app) as client:
        admin = Admin(client)
        acme = await admin.tenant_with_key("acme")
        globex = await admin.tenant_with_key("globex")

        # The operator only: a tenant's key and no credential are refused; nothing is loaded.
        assert (await load(client, bearer(acme), lora_name="style", lora_path="style")).status_code == 401
        assert (await load(client, {}, lora_name="style", lora_path="style")).status_code == 401
        assert (await unload(client, bearer(acme), lora_name="style")).status_code == 401

        base = await greedy(client, acme, BASE)
        r = await load(client, ADMIN, lora_name="style", lora_path=str(root / "style"))
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'style' added successfully."

        # Listed for every tenant with its parent, and served by its bare name and as operator/style.
        for key in (acme, globex):
            models = {
                m["id"]: m for m in (await client.get("/v1/models", headers=bearer(key))).json()["data"]
            }
            assert models["style"]["parent"] == BASE and models["style"]["owned_by"] == "operator"
        styled = await greedy(client, acme, "style")
        assert styled.status_code == 200, styled.text
        assert styled.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]
        assert (await greedy(client, globex, "operator/style")).json()["choices"] == styled.json()["choices"]

        # A tenant's own adapter of that name comes first, for that tenant only.
        make_peft_adapter(tiny_dirs["gqa_tied"], tmp_path / "own", seed=33, spec=ADAPTER_SPEC)
        assert (await upload(client, globex, "style", zip_bytes(tmp_path / "own"))).status_code == 201
        own = await greedy(client, globex, "style")
        assert own.json()["choices"] != styled.json()["choices"]
        assert (await greedy(client, acme, "style")).json()["choices"] == styled.json()["choices"]

        # vLLM's refusals.
        refusal(await load(client, ADMIN, lora_name="style"), 400, "InvalidUserInput", "Both 'lora_name' and")
        refusal(
            await load(client, ADMIN, lora_name="style", lora_path=str(root / "style")),
            400,
            "InvalidUserInput",
            "The lora adapter 'style' has already been loaded. If you want to load the adapter in place, "
            "set 'load_inplace' to True.",
        )
        refusal(
            await load(client, ADMIN, lora_name="x", lora_path="missing"),
            404,
            "NotFoundError",
            "No adapter found",
        )
        refusal(
            await load(client, ADMIN, lora_name="x", lora_path="escape"),
            400,
            "InvalidUserInput",
            "lora_load_root",
        )
        refusal(
            await load(client, ADMIN, lora_name="x", lora_path="/etc"),
            400,
            "InvalidUserInput",
            "lora_load_root",
        )
        refusal(
            await load(client, ADMIN, lora_name="x", lora_path="broken"),
            400,
            "BadRequestError",
            "Loading lora x",
        )
        refusal(
            await load(client, ADMIN, lora_name=BASE, lora_path="style"),
            400,
            "InvalidUserInput",
            "base model",
        )
        assert (await load(client, ADMIN, lora_name="y", lora_path="style", extra=1)).status_code == 400

        # load_inplace: a new version under the same name, served at the next request.
        r = await load(client, ADMIN, lora_name="style", lora_path="style-v2", load_inplace=True)
        assert r.status_code == 200, r.text
        second = await greedy(client, acme, "style")
        assert second.json()["choices"] != styled.json()["choices"]

        # A version already in the store, by its sha256: nothing to copy.
        listed = (await client.get("/admin/api/adapters?tenant=operator", headers=ADMIN)).json()["data"]
        version = listed[0]["version"]
        r = await load(client, ADMIN, lora_name="style-again", lora_path=version)
        assert r.status_code == 200, r.text
        assert (await greedy(client, acme, "style-again")).json()["choices"] == styled.json()["choices"]

        # Unload: gone from the list and from serving; a second unload is vLLM's 404.
        r = await unload(client, ADMIN, lora_name="style")
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'style' removed successfully."
        models = [m["id"] for m in (await client.get("/v1/models", headers=bearer(acme))).json()["data"]]
        assert "style" not in models and "style-again" in models
        assert (await greedy(client, acme, "style")).status_code == 404
        refusal(await unload(client, ADMIN, lora_name="style"), 404, "NotFoundError", "cannot be found")
        refusal(await unload(client, ADMIN), 400, "InvalidUserInput", "either 'lora_name' and 'lora_int_id'")
        gateway = app_state(app).gateway
        assert gateway is not None
        async with gateway.db.transaction() as session:
            operator = await tenants.get_tenant(session, "operator")
            (again,) = await adapters.list_adapters(session, operator)
        r = await unload(client, ADMIN, lora_int_id=again.id)  # the engine's int_id
        assert r.status_code == 200 and "style-again" in r.text
