"""Failures over a real socket (tiny model): a failed step, a dead engine, quick disconnects.

Step failures cannot be provoked with valid input any more (the engine validates
everything a request carries), so two tests inject a fault into the real engine:
the sampler raises for requests with a marker seed, or the scheduler raises.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from support.engines import tiny_engine
from support.servers import LiveServer, sse_lines, start_server, stream_text, wait_until

from loraplex.platform.api.app import build_app
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.settings import ServerSettings

POISON_SEED = 4242
BODY = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


_engine = partial(tiny_engine, num_kv_blocks=128, max_num_seqs=8)


@pytest.fixture
def live(tiny_dirs: dict[str, Path]) -> Iterator[LiveServer]:
    engine = _engine(tiny_dirs)
    real_sample = engine.sampler.sample

    def sample(logits: Any, params: Any, *args: Any) -> Any:
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("injected sampler fault")
        return real_sample(logits, params, *args)

    engine.sampler.sample = sample  # type: ignore[method-assign]
    server = start_server(engine, "tiny")
    yield server
    server.stop()


def test_a_failed_step_fails_its_request_and_the_server_goes_on(live: LiveServer) -> None:
    free = live.engine.kv.block_manager.num_free_blocks
    poisoned = {**BODY, "temperature": 1.0, "seed": POISON_SEED}
    with httpx.Client(base_url=live.url, timeout=60) as c:
        alone = c.post("/v1/completions", json=BODY).json()["choices"][0]["text"]
        with c.stream("POST", "/v1/completions", json={**poisoned, "stream": True}) as r:
            assert r.status_code == 200
            lines = list(sse_lines(r))
        assert lines[-1] == "[DONE]"
        _, errors = stream_text(lines)
        assert len(errors) == 1 and errors[0]["type"] == "server_error", errors
        r = c.post("/v1/completions", json=poisoned)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        assert c.get("/health").status_code == 200
        again = c.post("/v1/completions", json=BODY)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == alone
    wait_until(lambda: not live.engine.has_unfinished_requests(), 5, "idle")
    assert live.engine.kv.block_manager.num_free_blocks == free
    live.engine.check_integrity()


def _corrupting_scheduler_bug(engine: LLMEngine) -> Any:
    """A scheduler bug that leaves the KV bookkeeping inconsistent, then raises.

    A planning error alone only fails the requests it concerns (the engine checks its integrity
    and goes on serving); one that broke the engine's state must stop it: that is what these
    tests exercise.
    """

    def broken() -> Any:
        engine.kv.block_manager.pool.blocks[0].ref_cnt += 1  # a reference nobody holds
        raise RuntimeError("injected scheduler bug")

    return broken


def test_a_dead_engine_fails_requests_and_stops_the_server(tiny_dirs: dict[str, Path]) -> None:
    engine = _engine(tiny_dirs)
    live = start_server(engine, "tiny")
    with httpx.Client(base_url=live.url, timeout=60) as c:
        assert c.post("/v1/completions", json=BODY).status_code == 200

        engine.scheduler.schedule = _corrupting_scheduler_bug(engine)  # type: ignore[method-assign]
        with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
            lines = list(sse_lines(r))
    assert lines[-1] == "[DONE]"
    _, errors = stream_text(lines)
    assert len(errors) == 1 and errors[0]["code"] == "engine_dead", errors
    assert live.wait_exit(30) == 1, "the server must exit non-zero when its engine died"


def test_health_is_503_once_the_engine_died(tiny_dirs: dict[str, Path]) -> None:
    engine = _engine(tiny_dirs)
    aeng = AsyncEngine(engine)

    engine.scheduler.schedule = _corrupting_scheduler_bug(engine)  # type: ignore[method-assign]
    with TestClient(
        build_app(aeng, ServerSettings(served_model_name="tiny", single_tenant=True)),
        raise_server_exceptions=False,
    ) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert c.post("/v1/completions", json=BODY).status_code == 503
    assert aeng.error is not None and not aeng.is_alive
    aeng.shutdown()


def _send(live: LiveServer, body: dict[str, Any]) -> socket.socket:
    host, port = live.host_port
    sock = socket.create_connection((host, port))
    payload = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def test_disconnects_abort_running_and_queued_at_once(tiny_dirs: dict[str, Path]) -> None:
    engine = _engine(tiny_dirs, max_num_seqs=2)
    live = start_server(engine, "tiny")
    try:
        free = engine.kv.block_manager.num_free_blocks
        long = {**BODY, "max_tokens": 2000}
        socks = [_send(live, {**long, "stream": i % 2 == 0}) for i in range(5)]
        wait_until(lambda: len(engine.requests) == 5, 30, "all requests in the engine")
        steps = engine.num_steps
        wait_until(lambda: engine.num_steps > steps + 2, 30, "two running, three queued")
        assert len(engine.scheduler.running) == 2
        for sock in socks:
            sock.close()
        wait_until(lambda: not engine.has_unfinished_requests(), 2.0, "aborted")
        assert engine.kv.block_manager.num_free_blocks == free and not engine.requests
        engine.check_integrity()
    finally:
        assert live.stop() == 0


_SERVE_SCRIPT = """
import sys
from loraplex.platform.api.app import build_app
from loraplex.platform.settings import ServerLimits, ServerSettings
from loraplex.platform.api.server import serve
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine

engine = LLMEngine(EngineConfig(model=sys.argv[1], dtype="float32", num_kv_blocks=256))
app = build_app(
    AsyncEngine(engine),
    ServerSettings(served_model_name="tiny", single_tenant=True, limits=ServerLimits(graceful_shutdown_s=2)),
)
print("serving", flush=True)
sys.exit(serve(app, "127.0.0.1", int(sys.argv[2]), "warning"))
"""


def test_sigterm_stops_a_server_with_an_open_stream(tiny_dirs: dict[str, Path]) -> None:
    """After the grace period the open stream is cancelled and the process ends (as
    SIGTERM ends it: uvicorn raises the signal again once it has shut down)."""
    import signal
    import subprocess
    import sys
    import time

    from support.ports import free_port

    port = free_port()
    cmd = [sys.executable, "-c", _SERVE_SCRIPT, str(tiny_dirs["gqa_tied"]), str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _up(url) or proc.poll() is not None, 120, "server up")
        assert proc.poll() is None
        long = {**BODY, "max_tokens": 2000, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_lines())
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
            assert time.monotonic() - start < 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
