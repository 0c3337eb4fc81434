"""The gateway end to end: a real uvicorn on loopback, the official ``openai`` client and raw HTTP.

A tenant uploads a LoRA that ``peft`` saved for the tiny model, sees it in ``/v1/models``,
completes with it (completions and chat, whole and streamed) and gets exactly what the engine
computes with that adapter; every request leaves a usage record in the database.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from support.gateway import ADMIN, BASE, bearer, make_gateway, settings_for, zip_bytes
from support.ports import free_port
from support.servers import sse_lines, stream_text

from loraplex.adapters import LoRARequest
from loraplex.platform.api.server import Server
from loraplex.platform.api.services import tenants, usage
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.sampling_params import SamplingParams
from loraplex.storage.db import Database

PROMPT = "The capital of France is"
MAX_TOKENS = 6


@dataclass
class Gateway:
    url: str
    database_url: str
    store: Path
    key: str
    engine: AsyncEngine


@pytest.fixture(scope="module")
def gateway(gateway_engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("gateway")
    settings = settings_for(root, f"sqlite+aiosqlite:///{root / 'gateway.db'}", host="127.0.0.1")
    port = free_port()
    server = Server(make_gateway(gateway_engine, settings), "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=url, headers=ADMIN) as admin:
        assert admin.post("/admin/api/tenants", json={"name": "acme"}).status_code == 201
        key = admin.post("/admin/api/tenants/acme/keys", json={"name": "e2e"}).json()["key"]
    yield Gateway(
        url, settings.gateway.database_url_or_default, settings.gateway.adapter_store_dir, key, gateway_engine
    )
    server.stop()
    thread.join(60)


def reference_text(engine: AsyncEngine, adapter_dir: Path) -> str:
    """What the engine itself generates with the adapter loaded straight from its folder."""

    async def run() -> str:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        lora = LoRARequest("reference", 999_999, str(adapter_dir))
        final = None
        async for out in engine.generate(PROMPT, params, lora_request=lora):
            final = out
        assert final is not None
        return final.outputs[0].text

    return asyncio.run(run())


def test_upload_list_and_complete_with_openai_and_raw_http(gateway: Gateway, peft_adapter_dir: Path) -> None:
    with httpx.Client(base_url=gateway.url, headers=bearer(gateway.key), timeout=120) as http:
        up = http.post(
            "/v1/adapters",
            data={"name": "fr"},
            files={"file": ("fr.zip", zip_bytes(peft_adapter_dir, prefix="fr/"), "application/zip")},
        )
        assert up.status_code == 201, up.text
        adapter = up.json()
        assert (adapter["owner"], adapter["visibility"], adapter["rank"]) == ("acme", "private", 4)
        assert adapter["target_modules"] == ["q_proj", "v_proj"]
        assert (gateway.store / adapter["version"] / "adapter_model.safetensors").is_file()

        # The same adapter as its two files is the same content: the same version, one folder.
        with (
            (peft_adapter_dir / "adapter_config.json").open("rb") as cfg,
            (peft_adapter_dir / "adapter_model.safetensors").open("rb") as weights,
        ):
            two = http.post(
                "/v1/adapters",
                data={"name": "fr-files", "visibility": "private"},
                files={
                    "adapter_config": ("adapter_config.json", cfg),
                    "adapter_model": ("w.safetensors", weights),
                },
            )
        assert two.status_code == 201, two.text
        assert two.json()["version"] == adapter["version"]
        assert sorted(p.name for p in gateway.store.iterdir()) == [adapter["version"]]

        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=gateway.key, max_retries=0)
        assert [m.id for m in client.models.list().data] == [BASE, "fr", "fr-files"]

        extra = {"ignore_eos": True}
        whole = client.completions.create(
            model="fr", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        text = whole.choices[0].text
        assert whole.model == "fr" and whole.usage is not None and whole.usage.completion_tokens == MAX_TOKENS
        assert text == reference_text(gateway.engine, peft_adapter_dir)
        base = client.completions.create(
            model=BASE, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        assert base.choices[0].text != text, "the adapter changed nothing"

        streamed = client.completions.create(
            model="fr", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body=extra
        )
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == text

        raw = http.post(
            "/v1/completions",
            json={
                "model": "fr",
                "prompt": PROMPT,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert raw.status_code == 200 and raw.json()["choices"][0]["text"] == text

        messages = [{"role": "user", "content": "Say something."}]
        chat = client.chat.completions.create(
            model="fr", messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        chat_text = chat.choices[0].message.content
        assert chat.model == "fr" and chat_text
        chunks = client.chat.completions.create(
            model="fr", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body=extra
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_text

        body = {
            "model": "fr",
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
        }
        with http.stream("POST", "/v1/chat/completions", json={**body, "ignore_eos": True}) as r:
            assert r.status_code == 200
            lines = list(sse_lines(r))
        assert lines[-1] == "[DONE]"
        assert stream_text(lines) == (chat_text, [])

        # Wrong key: 401 in OpenAI's shape, which the client raises as AuthenticationError.
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=gateway.url + "/v1", api_key="lpx-wrong", max_retries=0).models.list()

    # Seven generations: six on the adapter, one on the base model; listing models records nothing.
    records = asyncio.run(usage_of(gateway.database_url, "acme", expected=7))
    with_adapter = [r for r in records if r.adapter_name == "fr"]
    assert len(with_adapter) == 6 and all(r.status == "ok" for r in records)
    assert {r.adapter_version for r in with_adapter} == {adapter["version"]}
    assert all(
        r.completion_tokens == MAX_TOKENS and r.prompt_tokens > 0 and r.latency_ms > 0 for r in records
    )


async def usage_of(database_url: str, tenant: str, expected: int) -> list[usage.UsageRecord]:
    """The tenant's usage records, once ``expected`` of them are there (they are written after
    the response, in the background)."""
    db = Database(database_url)
    try:
        deadline = time.monotonic() + 10
        while True:
            async with db.transaction() as session:
                owner = await tenants.get_tenant(session, tenant)
                records = await usage.query_usage(session, usage.UsageFilter(tenant=owner))
            if len(records) >= expected or time.monotonic() > deadline:
                assert len(records) == expected, [json.dumps([r.request_id, r.status]) for r in records]
                return records
            await asyncio.sleep(0.05)
    finally:
        await db.dispose()
