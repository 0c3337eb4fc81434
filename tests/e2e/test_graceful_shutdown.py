"""SIGTERM under load: the server drains (``loraplex.platform.api.server``).

A real process on a real port (the tiny model, a disk tier): streams that can finish within
``graceful_shutdown_s`` finish with every token; those that cannot end with an error event
and ``[DONE]`` (never cut); while it drains, ``/ready`` and new requests answer 503 at once,
and the process still persists its KV and exits by the signal.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.ports import free_port
from support.servers import wait_until

GRACE_S = 3
SHORT_TOKENS = 24
LONG_TOKENS = 2000  # with 8 such streams a step-bound CPU needs far more than GRACE_S

_SERVE = """
import logging
import sys
from loraplex.platform.api.app import build_app
from loraplex.platform.settings import ServerLimits, ServerSettings
from loraplex.platform.api.server import serve
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine

config = EngineConfig(
    model=sys.argv[1], dtype="float32", num_kv_blocks=1200, block_size=16, max_num_seqs=16,
    host_kv_cache_bytes=1 << 20, disk_kv_path=sys.argv[3], disk_kv_cache_bytes=4 << 20,
)
logging.basicConfig(level=logging.INFO)
settings = ServerSettings(
    served_model_name="tiny", single_tenant=True, limits=ServerLimits(graceful_shutdown_s=int(sys.argv[4]))
)
sys.exit(serve(build_app(AsyncEngine(LLMEngine(config)), settings), "127.0.0.1", int(sys.argv[2]), "info"))
"""


def _body(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": [5, 6, 7, 8],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "logprobs": 0,  # one entry per token: a chunk may carry several when the reader lags
    }


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def _stream(
    client: httpx.AsyncClient, max_tokens: int, started: asyncio.Event
) -> list[dict[str, Any] | str]:
    """Every event of one streamed completion (``[DONE]`` as the string)."""
    events: list[dict[str, Any] | str] = []
    async with client.stream("POST", "/v1/completions", json=_body(max_tokens)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
            started.set()
    return events


def _tokens(events: list[dict[str, Any] | str]) -> int:
    """Tokens streamed, counted by their logprobs entries (not chunks: the stream keeps a backlog of
    one output, so a reader that lags gets the tokens of several steps in one chunk)."""
    return sum(
        len((e["choices"][0].get("logprobs") or {}).get("tokens") or [])
        for e in events
        if isinstance(e, dict) and "choices" in e
    )


@pytest.mark.slow
def test_sigterm_under_load_finishes_what_it_can_and_ends_the_rest_with_an_error_event(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-c",
        _SERVE,
        str(tiny_dirs["gqa_tied"]),
        str(port),
        str(tmp_path / "kv"),
        str(GRACE_S),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: _up(url) or proc.poll() is not None, 120, "server up")
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else "server exited"
        result = asyncio.run(_load_then_sigterm(url, proc))
        code = proc.wait(timeout=60)
        log = proc.stdout.read() if proc.stdout else ""
        assert code == -signal.SIGTERM, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    shorts, longs, whole, after = result
    for events in shorts:  # admitted and able to finish within the grace: every token
        assert events[-1] == "[DONE]"
        assert _tokens(events) == SHORT_TOKENS
        assert events[-2]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    for events in longs:  # could not finish: an error event, then [DONE]
        assert events[-1] == "[DONE]", events[-3:]
        error = events[-2]
        assert isinstance(error, dict) and error["error"]["code"] == "engine_dead", error
        assert 0 < _tokens(events) < LONG_TOKENS
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "engine_dead"
    ready, refused, drain_answer_s = after
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "shutting_down"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert drain_answer_s < 1.0
    assert "KV tiers closed" in log, log  # then the KV was persisted, as on every clean stop


async def _load_then_sigterm(url: str, proc: subprocess.Popen[str]) -> tuple[Any, ...]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        started = [asyncio.Event() for _ in range(12)]
        longs = [asyncio.ensure_future(_stream(client, LONG_TOKENS, started[i])) for i in range(8)]
        whole = asyncio.ensure_future(client.post("/v1/completions", json=_body(LONG_TOKENS, stream=False)))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started[:8])), 60)
        shorts = [asyncio.ensure_future(_stream(client, SHORT_TOKENS, started[8 + i])) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started[8:])), 60)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        await asyncio.sleep(0.2)  # the signal is picked up at uvicorn's next tick (0.1 s)
        ready = await client.get("/ready")
        refused = await client.post("/v1/completions", json=_body(4, stream=False))
        drain_answer_s = time.monotonic() - t0
        return (
            await asyncio.gather(*shorts),
            await asyncio.gather(*longs),
            await whole,
            (ready, refused, drain_answer_s),
        )
