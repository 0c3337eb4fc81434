"""Every error is OpenAI's body, every limit is enforced (tiny model, in-process ASGI)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from loraplex.platform.api.app import build_app
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.settings import ServerLimits, ServerSettings

LIMITS = ServerLimits(
    max_request_body_bytes=4096,
    max_prompt_chars=300,
    max_stop_strings=2,
    max_stop_string_chars=8,
    max_stop_token_ids=3,
    max_n=6,
    max_completion_logprobs=2,
    max_top_logprobs=3,
)
MAX_NUM_SEQS = 4
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def client(tiny_dirs: dict[str, Path]) -> Iterator[tuple[TestClient, LLMEngine]]:
    config = EngineConfig(
        model=str(tiny_dirs["gqa_tied"]),
        dtype="float32",
        num_kv_blocks=64,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
    )
    engine = LLMEngine(config)
    aeng = AsyncEngine(engine)
    app = build_app(aeng, ServerSettings(served_model_name="tiny", single_tenant=True, limits=LIMITS))

    @app.get("/test-only/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as c:
        yield c, engine
    aeng.shutdown()


BAD_SCHEMA = {"name": "x", "schema": {"type": "string", "pattern": "(("}}
TOOL_F = {"type": "function", "function": {"name": "f"}}
CHOOSE_G = {"type": "function", "function": {"name": "g"}}


def _error(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    message = body["error"]["message"]
    assert message and not message.startswith(("None", "body")) and "JSON decode error" not in message
    return dict(body["error"])


JSON = {"content-type": "application/json"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "path", "raw", "status", "param", "code"),
    [
        ("GET", "/nope", None, 404, None, "not_found"),
        ("GET", "/v1/completions", None, 405, None, "method_not_allowed"),
        ("DELETE", "/v1/models", None, 405, None, "method_not_allowed"),
        ("POST", "/v1/completions", b'{"prompt": "hi",', 400, None, None),
        ("POST", "/v1/completions", b"", 400, None, None),
        ("POST", "/v1/completions", b'{"prompt": "caf\xe9"}', 400, None, None),
        ("POST", "/v1/completions", b'{"prompt": "\\ud800"}', 400, "prompt", None),
        ("POST", "/v1/completions", b'{"prompt": ["ok", "\\udc00"]}', 400, "prompt.1", None),
        ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', 400,
         "messages.0.content", None),
        ("POST", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, None, None),
        ("POST", "/v1/completions", b'{"prompt": "hi", "top_p": Infinity}', 400, None, None),
        ("POST", "/v1/completions", b"[1, 2]", 400, None, None),
        ("POST", "/v1/completions", b'{"max_tokens": 2}', 400, "prompt", None),
        ("POST", "/v1/completions", b'{"prompt": {"a": 1}}', 400, "prompt", None),
        ("POST", "/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature", None),
        ("POST", "/v1/completions", b'{"prompt": "hi", "n": true}', 400, "n", None),
        ("POST", "/v1/chat/completions", b'{"messages": []}', 400, "messages", None),
        ("POST", "/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', 400,
         "messages.0.role", None),
        ("POST", "/v1/completions", b'{"prompt": "hi", "model": "nope"}', 404, "model", "model_not_found"),
        ("GET", "/v1/models/nope", None, 404, "model", "model_not_found"),
        ("GET", "/test-only/boom", None, 500, None, "internal_error"),
    ],
)  # fmt: skip
def test_every_error_is_openai_body(
    client: tuple[TestClient, LLMEngine],
    method: str,
    path: str,
    raw: bytes | None,
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    c, engine = client
    r = c.request(method, path, content=raw, headers=JSON if raw is not None else None)
    err = _error(r, status)
    assert (err["param"], err["code"]) == (param, code)
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert not engine.has_unfinished_requests()


def test_body_size_limit_declared_and_streamed(client: tuple[TestClient, LLMEngine]) -> None:
    c, _ = client
    big = b'{"prompt": "' + b"x" * 5000 + b'"}'
    assert _error(c.post("/v1/completions", content=big, headers=JSON), 413)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    assert (
        _error(c.post("/v1/completions", content=chunks(), headers=JSON), 413)["code"] == "request_too_large"
    )


BASE = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x" * 301}, "prompt"),
        ("/v1/completions", {"prompt": ["x" * 200, "y" * 101]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 301}]}, "messages"),
        ("/v1/completions", {"n": 7}, "n"),
        ("/v1/completions", {"prompt": ["a", "b", "c", "d"], "n": 2}, "n"),
        ("/v1/completions", {"stop": ["a", "b", "c"]}, "stop"),
        ("/v1/completions", {"stop": "123456789"}, "stop"),
        ("/v1/completions", {"stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids"),
        ("/v1/completions", {"logprobs": 3}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 4}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
        # unsupported OpenAI fields: refused, never ignored
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"logit_bias": {"5": 10}}, "logit_bias"),
        # beam search (served since stop 50): what it cannot honour is refused by name
        ("/v1/completions", {"use_beam_search": True, "top_p": 0.5}, "top_p"),
        ("/v1/chat/completions", {"use_beam_search": True, "temperature": 0.5}, "temperature"),
        # structured outputs and tools (issue 40): malformed shapes and hostile schemas name the field
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": BAD_SCHEMA}},
         "response_format"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "tools.0.function.name"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"tools": [TOOL_F], "tool_choice": CHOOSE_G}, "tool_choice"),
        ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ("/v1/completions", {"structured_outputs": {"xml": "a"}}, "structured_outputs"),
        ("/v1/completions", {"guided_choice": []}, "guided_choice"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages.0.content.0"),
        # the engine's own refusals, with the field it names
        ("/v1/completions", {"n": MAX_NUM_SEQS + 1}, "n"),
        ("/v1/completions", {"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ("/v1/completions", {"temperature": -1}, "temperature"),
        ("/v1/completions", {"top_k": 2**70}, "top_k"),
    ],
)  # fmt: skip
def test_limits_and_refusals_name_the_field(
    client: tuple[TestClient, LLMEngine], path: str, body: dict[str, Any], param: str
) -> None:
    c, engine = client
    base = BASE if path.endswith("/completions") and "chat" not in path else CHAT
    for stream in (False, True):
        err = _error(c.post(path, json={**base, **body, "stream": stream}), 400)
        assert err["param"] == param, err
    assert not engine.has_unfinished_requests()


TEXT_PART = {"type": "text", "text": "hi"}


def test_accepted_forms(client: tuple[TestClient, LLMEngine]) -> None:
    c, _ = client
    ok = [
        ("/v1/completions", {**BASE, "best_of": 1}),
        ("/v1/completions", {**BASE, "echo": False, "suffix": None, "logit_bias": {}}),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}, "tool_choice": "none"}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [TEXT_PART]}]}),
        ("/v1/completions", {**BASE, "unknown_field": 1}),
    ]  # fmt: skip
    for path, body in ok:
        r = c.post(path, json=body)
        assert r.status_code == 200, (body, r.text)


def test_limits_validate() -> None:
    for bad in (
        {"max_n": 0},
        {"max_request_body_bytes": 10},
        {"max_stop_strings": True},
        {"max_top_logprobs": -1},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerLimits(**bad)  # type: ignore[arg-type]
    assert ServerLimits(max_completion_logprobs=0).max_completion_logprobs == 0


def test_adapter_named_like_the_model_is_refused(client: tuple[TestClient, LLMEngine]) -> None:
    from loraplex.adapters import LoRARequest

    c, _ = client
    aeng = c.app.state.loraplex.engine  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="served model name"):
        build_app(
            aeng,
            ServerSettings(served_model_name="tiny", single_tenant=True),
            {"tiny": LoRARequest("tiny", 1, "/nowhere")},
        )


def test_a_failed_requests_status_comes_from_its_error_kind_never_its_text() -> None:
    from loraplex.platform.api.errors import overloaded, request_error
    from loraplex.platform.engine.errors import EngineOverloadedError, ErrorKind, RequestError

    expected = {
        ErrorKind.DEADLINE: (408, "request_timeout"),
        ErrorKind.ABORTED: (503, "request_aborted"),
        ErrorKind.ADAPTER_UNAVAILABLE: (503, "adapter_unavailable"),
        ErrorKind.OVERLOAD: (503, "overloaded"),
        ErrorKind.INVALID: (400, "invalid_value"),
        ErrorKind.ENGINE_FAILURE: (500, "internal_error"),
    }
    assert set(expected) == set(ErrorKind)
    for kind, (status, code) in expected.items():
        # The same misleading text under every kind: only the kind decides.
        answer = request_error(RequestError(kind, "internal error: adapter removed, deadline"))
        assert (answer.status, answer.code) == (status, code), kind
        assert ("Retry-After" in answer.headers) == (status == 503)
        assert answer.body()["error"]["message"].endswith("internal error: adapter removed, deadline")
    refused = overloaded(EngineOverloadedError(7, 7))
    assert (refused.status, refused.code, refused.headers) == (503, "overloaded", {"Retry-After": "1"})
