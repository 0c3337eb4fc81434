"""OpenAI response shapes: logprobs, prompt lists, max_completion_tokens, /v1/models (tiny model)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from loraplex.platform.api.app import build_app
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.settings import ServerSettings

GREEDY = {"model": "tiny", "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(tiny_dirs: dict[str, Path]) -> Iterator[TestClient]:
    engine = LLMEngine(EngineConfig(model=str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=64))
    aeng = AsyncEngine(engine)
    with TestClient(build_app(aeng, ServerSettings(served_model_name="tiny", single_tenant=True))) as c:
        c.llm_engine = engine  # type: ignore[attr-defined]  # the engine under the door, for checks
        yield c
    aeng.shutdown()


def _stream(c: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_completion_logprobs_whole_and_streamed(client: TestClient) -> None:
    body = {**GREEDY, "prompt": [5, 6, 7, 8], "max_tokens": 5, "logprobs": 2}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(5)]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert 2 <= len(top) <= 3 and value <= 0
        # greedy: the sampled token is the most likely one
        assert top[token] == pytest.approx(max(top.values()))
    chunks = _stream(client, "/v1/completions", body)
    streamed: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for chunk in chunks:
        for key in streamed:
            streamed[key].extend(chunk["choices"][0]["logprobs"][key])
    assert streamed == lp


def test_chat_logprobs(client: TestClient) -> None:
    body = {**GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert plain["logprobs"] is None
    choice = client.post("/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 3}).json()
    content = choice["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    assert "".join(t["token"] for t in content) == choice["choices"][0]["message"]["content"]
    for t in content:
        assert t["bytes"] == list(t["token"].encode())
        top = [alt["logprob"] for alt in t["top_logprobs"]]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert t["logprob"] == pytest.approx(top[0])
    only_sampled = client.post("/v1/chat/completions", json={**body, "logprobs": True}).json()
    assert all(t["top_logprobs"] == [] for t in only_sampled["choices"][0]["logprobs"]["content"])
    chunks = _stream(client, "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 3})
    streamed = [t for ch in chunks for t in (ch["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert streamed == content


def test_prompt_lists_give_indexed_choices(client: TestClient) -> None:
    base = {**GREEDY, "max_tokens": 3}
    single = {
        p: client.post("/v1/completions", json={**base, "prompt": p}).json()["choices"][0]["text"]
        for p in ("hello", "world")
    }
    one = client.post("/v1/completions", json={**base, "prompt": ["hello"]}).json()
    assert [c["text"] for c in one["choices"]] == [single["hello"]]
    both = client.post("/v1/completions", json={**base, "prompt": ["hello", "world"], "n": 2}).json()
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in both["choices"]] == [single["hello"]] * 2 + [single["world"]] * 2
    assert both["usage"]["completion_tokens"] == 12
    ids = client.post("/v1/completions", json={**base, "prompt": [[5, 6], [7, 8]]}).json()
    assert [c["index"] for c in ids["choices"]] == [0, 1] and ids["usage"]["prompt_tokens"] == 4
    chunks = _stream(client, "/v1/completions", {**base, "prompt": ["hello", "world"], "n": 2})
    texts: dict[int, str] = {}
    finishes: list[int] = []
    for ch in chunks:
        for c in ch["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"] is not None:
                finishes.append(c["index"])
    assert texts == {0: single["hello"], 1: single["hello"], 2: single["world"], 3: single["world"]}
    assert sorted(finishes) == [0, 1, 2, 3]  # each choice ends exactly once


def test_max_completion_tokens_wins_over_max_tokens(client: TestClient) -> None:
    body = {**GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    r = client.post("/v1/chat/completions", json={**body, "max_completion_tokens": 2}).json()
    assert r["usage"]["completion_tokens"] == 2
    assert client.post("/v1/chat/completions", json=body).json()["usage"]["completion_tokens"] == 6


def test_models_have_created(client: TestClient) -> None:
    data = client.get("/v1/models").json()["data"]
    assert data[0]["id"] == "tiny" and isinstance(data[0]["created"], int) and data[0]["created"] > 0
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"


def test_a_refused_prompt_in_a_list_refuses_the_request(client: TestClient) -> None:
    engine = client.llm_engine  # type: ignore[attr-defined]
    free = engine.kv.block_manager.num_free_blocks
    body = {**GREEDY, "prompt": [[5, 6], [10**9], [7, 8]], "max_tokens": 50}
    for stream in (False, True):
        r = client.post("/v1/completions", json={**body, "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    deadline = time.monotonic() + 5
    while engine.has_unfinished_requests():  # the accepted siblings are aborted
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert engine.kv.block_manager.num_free_blocks == free
