"""The OpenAI-compatible server over a real engine (tiny random model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from loraplex import LLM, SamplingParams
from loraplex.platform.api.app import build_app
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.settings import ServerSettings


@pytest.fixture(scope="module")
def client(tiny_dirs: dict[str, Path]) -> Iterator[tuple[TestClient, LLMEngine]]:
    engine = LLMEngine(EngineConfig(model=str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=64))
    aeng = AsyncEngine(engine)
    with TestClient(build_app(aeng, ServerSettings(served_model_name="tiny", single_tenant=True))) as c:
        yield c, engine
    aeng.shutdown()


def test_models_and_health(client: tuple[TestClient, LLMEngine]) -> None:
    c, _ = client
    assert c.get("/health").json() == {"status": "ok"}
    assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_completion_equals_offline_greedy(
    client: tuple[TestClient, LLMEngine], tiny_dirs: dict[str, Path]
) -> None:
    c, engine = client
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    offline = LLM(model=str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=64)
    ref = offline.generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    assert data["choices"][0]["text"] == ref[0].outputs[0].text
    assert data["usage"]["completion_tokens"] == 6 and data["usage"]["prompt_tokens"] == 4
    engine.check_integrity()


def test_streaming_chat_with_usage(client: tuple[TestClient, LLMEngine]) -> None:
    c, engine = client
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    full = c.post("/v1/chat/completions", json={**body, "stream": False}).json()
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    assert text == full["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    engine.check_integrity()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "", "max_tokens": 3}, "prompt"),
        ({"prompt": "hi", "top_p": 2}, "top_p"),
        ({"prompt": "hi", "n": 0}, "n"),
    ],
)
def test_bad_input_gets_openai_error(client: tuple[TestClient, LLMEngine], body: dict, param: str) -> None:
    c, engine = client
    for stream in (False, True):
        r = c.post("/v1/completions", json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert param in err["message"] and err["type"] == "invalid_request_error"
    assert not engine.has_unfinished_requests()


def test_unknown_model_is_404(client: tuple[TestClient, LLMEngine]) -> None:
    c, _ = client
    r = c.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
