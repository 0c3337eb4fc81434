"""Issue 12 against a real server: SmolLM2 (with one adapter) behind uvicorn on loopback.

One test per finding of the issue (1-6), each failing on the server as it was, and
acceptance 3: abandoned requests (streamed or not, queued or running) are aborted
at once, the engine goes idle, blocks and adapter pins return to where they were.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.adapters import make_small_adapter
from support.servers import LiveServer, sse_lines, start_server, stream_text, wait_until

from loraplex.adapters import LoRARequest
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 1024
GREEDY = {"model": "smol", "prompt": "The capital of France is", "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def live(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    adapter = make_small_adapter(smollm2_dir, tmp_path_factory.mktemp("adapters") / "tone")
    config = EngineConfig(
        kv_cache_memory=256 << 20,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    engine = LLMEngine(config)
    lora = LoRARequest("tone", 1, str(adapter))
    engine.add_lora(lora)
    server = start_server(engine, "smol", {"tone": lora})
    yield server
    assert server.stop() == 0


@pytest.fixture
def client(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=60) as c:
        yield c


def _idle(live: LiveServer, timeout_s: float = 5.0) -> None:
    wait_until(lambda: not live.engine.has_unfinished_requests(), timeout_s, "engine idle")


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return dict(err)


def test_finding1_unadmittable_requests_are_refused_at_once(live: LiveServer, client: httpx.Client) -> None:
    """n over max_num_seqs, or prompt + max_tokens over the context: 400 now, not a stuck queue."""
    too_long_prompt = [5] * (MAX_MODEL_LEN + 10)
    cases = [
        ({**GREEDY, "n": MAX_NUM_SEQS + 1, "max_tokens": 2}, "n"),
        ({**GREEDY, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({**GREEDY, "prompt": too_long_prompt, "max_tokens": 2}, None),
    ]
    for body, param in cases:
        for stream in (False, True):
            start = time.monotonic()
            r = client.post("/v1/completions", json={**body, "stream": stream}, timeout=10)
            err = _error(r, 400)
            assert time.monotonic() - start < 5
            if param is not None:
                assert err["param"] == param, err
    ok = client.post("/v1/completions", json={**GREEDY, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    _idle(live)
    live.engine.check_integrity()


def test_finding2_bad_requests_leave_a_concurrent_stream_untouched(
    live: LiveServer, client: httpx.Client
) -> None:
    """Requests that used to crash the step get a 400 (or complete); a stream running
    meanwhile ends with [DONE] and the same greedy text as alone."""
    body = {**GREEDY, "max_tokens": 12}
    alone = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    bad_bodies: list[bytes] = [
        json.dumps({**GREEDY, "temperature": 1e-40, "max_tokens": 2}).encode(),
        json.dumps({**GREEDY, "logprobs": 100000, "max_tokens": 2}).encode(),
        b'{"model": "smol", "prompt": "Hi", "max_tokens": 2, "temperature": NaN}',
        b'{"model": "smol", "prompt": "Hi", "max_tokens": 2, "presence_penalty": NaN}',
        json.dumps({**GREEDY, "temperature": 1, "top_k": 2**70, "max_tokens": 2}).encode(),
        json.dumps({**GREEDY, "temperature": 1, "seed": 2**63 - 1, "n": 2, "max_tokens": 2}).encode(),
        json.dumps({**GREEDY, "temperature": 1e308, "max_tokens": 2}).encode(),
    ]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = sse_lines(r)
        received = [next(lines)]  # the stream runs before the bad requests arrive
        for raw in bad_bodies:
            bad = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert bad.status_code in (200, 400), (raw, bad.text)
            if bad.status_code == 200:
                assert all(c["finish_reason"] in ("length", "stop") for c in bad.json()["choices"])
            else:
                _error(bad, 400)
        received.extend(lines)
    assert received[-1] == "[DONE]"
    text, errors = stream_text(received)
    assert not errors
    assert text == alone
    _idle(live)
    live.engine.check_integrity()


def _open_client(live: LiveServer, path: str, body: dict[str, Any]) -> socket.socket:
    """A raw HTTP client that sends its request and never reads the answer."""
    host, port = live.host_port
    sock = socket.create_connection((host, port))
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock


def _abandon(live: LiveServer, num_clients: int) -> None:
    """Start ``num_clients`` requests (streamed or not, base or adapter, running or
    queued behind max_num_seqs), drop every connection, and check the engine lets go."""
    engine = live.engine
    _idle(live)
    free_at_start = engine.kv.block_manager.num_free_blocks
    kv_at_start = engine.kv.block_counts().num_used_device_blocks
    pins_at_start = engine.lora_runtime.num_pins
    socks = []
    for i in range(num_clients):
        body = {
            **GREEDY,
            "model": "tone" if i % 3 == 0 else "smol",
            "max_tokens": 400,
            "stream": i % 2 == 0,
        }
        path = "/v1/completions" if i % 4 else "/v1/chat/completions"
        if path.endswith("chat/completions"):
            body = {k: v for k, v in body.items() if k != "prompt"}
            body["messages"] = [{"role": "user", "content": f"Tell me a long story, number {i}."}]
        socks.append(_open_client(live, path, body))
    wait_until(lambda: len(engine.requests) == num_clients, 60, "every request reached the engine")
    # Leave once the running ones decode: an abort lands between steps, and a prefill
    # step on a loaded CI core can alone take longer than the 2 s this test allows.
    wait_until(lambda: engine.kv.block_manager.num_free_blocks < free_at_start, 60, "some requests run")
    first = engine.num_steps
    wait_until(lambda: engine.num_steps >= first + 2, 60, "the running requests decode")
    assert engine.scheduler.num_unfinished == num_clients  # some run, the rest wait
    for sock in socks:
        sock.close()
    took = wait_until(lambda: not engine.has_unfinished_requests(), 2.0, "every abandoned request aborted")
    cpu_start = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - cpu_start < 0.3, "the server still burns CPU after its clients left"
    # Every KV block is back (adapters loaded meanwhile keep the pool blocks they borrowed).
    assert engine.kv.block_counts().num_used_device_blocks == kv_at_start
    assert engine.lora_runtime.num_pins == pins_at_start
    assert not engine.requests
    engine.check_integrity()
    assert took < 2.0


def test_finding3_disconnects_abort_queued_and_running(live: LiveServer) -> None:
    _abandon(live, MAX_NUM_SEQS + 4)


def test_acceptance3_hundred_clients_disconnect(live: LiveServer) -> None:
    _abandon(live, 100)


def _read_response(sock: socket.socket) -> str:
    """Headers and the whole body (they may arrive in separate packets)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return (head + b"\r\n\r\n" + body).decode(errors="replace")


def test_finding4_input_limits_and_no_blocking(live: LiveServer, client: httpx.Client) -> None:
    limits = live.server.state.limits
    # A 50 MB body is refused from its Content-Length, before it is read.
    host, port = live.host_port
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {50 * 1024 * 1024}\r\n\r\n".encode()
            + b'{"prompt": "'
            + b"x" * 65536
        )
        start = time.monotonic()
        answer = _read_response(sock)
        assert answer.startswith("HTTP/1.1 413"), answer[:200]
        assert time.monotonic() - start < 2
        assert '"code":"request_too_large"' in answer.replace(" ", "")
    # Prompt text over the limit: refused before tokenization.
    start = time.monotonic()
    r = client.post("/v1/completions", json={**GREEDY, "prompt": "a" * (limits.max_prompt_chars + 1)})
    assert _error(r, 400)["param"] == "prompt"
    assert time.monotonic() - start < 3
    # A long prompt (under the limit) tokenizes off the event loop and outside the engine:
    # /health stays fast and a running stream keeps receiving tokens meanwhile.
    big = "hello world, this is a long prompt. " * (limits.max_prompt_chars // 40)
    health_latency: list[float] = []
    chunks_during: list[int] = []

    def post(path: str, body: dict[str, Any]) -> httpx.Response:
        with httpx.Client(base_url=live.url, timeout=120) as other:
            return other.post(path, json=body)

    pool = ThreadPoolExecutor(max_workers=1)
    with client.stream("POST", "/v1/completions", json={**GREEDY, "max_tokens": 200, "stream": True}) as r:
        lines = sse_lines(r)
        next(lines)
        for path, body in (
            ("/v1/completions", {**GREEDY, "prompt": big, "max_tokens": 2}),
            ("/v1/chat/completions", {"model": "smol", "messages": [{"role": "user", "content": big}]}),
        ):
            future = pool.submit(post, path, body)
            got = 0
            while not future.done():
                t0 = time.monotonic()
                assert client.get("/health", timeout=10).status_code == 200
                health_latency.append(time.monotonic() - t0)
                next(lines)
                got += 1
            chunks_during.append(got)
            # Too long for the context once tokenized: the engine refuses it.
            assert _error(future.result(), 400)["param"] in ("prompt", "messages", "max_tokens")
    pool.shutdown()
    assert max(health_latency) < 1.0, health_latency
    assert min(chunks_during) >= 1, chunks_during
    _idle(live)


def test_finding5_lone_surrogates_are_a_400(live: LiveServer, client: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    raw_completion = b'{"model": "smol", "prompt": "bad \\ud800 text", "max_tokens": 2}'
    r = client.post("/v1/completions", content=raw_completion, headers=headers)
    assert _error(r, 400)["param"] == "prompt"
    raw_chat = b'{"model": "smol", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'
    r = client.post("/v1/chat/completions", content=raw_chat, headers=headers)
    assert _error(r, 400)["param"] == "messages.0.content"
    # The connection survives: the same client goes on.
    assert client.post("/v1/completions", json={**GREEDY, "max_tokens": 1}).status_code == 200


def test_finding6_openai_behaviour(live: LiveServer, client: httpx.Client) -> None:
    oa = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)
    # logprobs in both shapes
    cmpl = oa.completions.create(
        model="smol", prompt=["The capital of France is"], max_tokens=3, temperature=0, logprobs=2
    )
    lp = cmpl.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 3
    assert lp.token_logprobs is not None and all(v <= 0 for v in lp.token_logprobs)
    assert lp.top_logprobs is not None and all(2 <= len(d) <= 3 for d in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(3)]
    assert "".join(lp.tokens) == cmpl.choices[0].text
    chat = oa.chat.completions.create(
        model="tone",
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode()) for t in content)
    # refused, never ignored
    refusals: list[tuple[str, dict[str, Any]]] = [
        ("echo", {"echo": True}),
        ("suffix", {"suffix": "!"}),
        ("max_tokens", {"max_tokens": 0}),
    ]
    for param, extra in refusals:
        with pytest.raises(openai.BadRequestError) as info:
            oa.completions.create(model="smol", prompt="Hi", **extra)
        assert info.value.param == param
    chat_refusals: list[tuple[str, dict[str, Any]]] = [
        ("response_format", {"response_format": {"type": "xml"}}),
        ("tools.0.function.name", {"tools": [{"type": "function", "function": {"name": "f f"}}]}),
        ("max_completion_tokens", {"max_completion_tokens": 0}),
    ]
    for param, extra in chat_refusals:
        with pytest.raises(openai.BadRequestError) as info:
            oa.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], **extra)
        assert info.value.param == param
    with pytest.raises(openai.BadRequestError):  # prompt + max_tokens over the context (vLLM: 400)
        oa.completions.create(model="smol", prompt="Hi", max_tokens=MAX_MODEL_LEN)
    with pytest.raises(openai.NotFoundError) as missing:
        oa.completions.create(model="nope", prompt="Hi", max_tokens=1)
    assert missing.value.code == "model_not_found"
    # a prompt list of one string is one prompt
    one = oa.completions.create(model="smol", prompt=["Hi"], max_tokens=2, temperature=0)
    assert len(one.choices) == 1 and one.choices[0].index == 0
    # streaming through the official client, with usage
    stream = oa.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=3,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    # /v1/models entries carry created
    models = oa.models.list().data
    assert [m.id for m in models] == ["smol", "tone"] and all(m.created > 0 for m in models)
    assert oa.models.retrieve("tone").id == "tone"
    # FastAPI's own errors and decode errors speak OpenAI, with readable messages
    err = _error(client.get("/v1/completions"), 405)
    assert err["code"] == "method_not_allowed"
    headers = {"content-type": "application/json"}
    for raw in (b'{"prompt": "\xff\xfe"}', b'{"prompt": "Hi",', b"not json"):
        message = _error(client.post("/v1/completions", content=raw, headers=headers), 400)["message"]
        assert not message.startswith(("None", "32")) and "JSON decode error" not in message, message
