"""Hostile clients, round two: what a tenant can do with its sockets rather than its bodies.

A real gateway (uvicorn on loopback, keys mode, SQLite) in a thread of the test process, so the
tests can hold sockets the way a hostile client does (open and never read, half-sent) and still
read the engine's state. Each test states the bound it checks; each fails on a gateway without the
limit it covers (an unbounded per-request queue, no write timeout, ...).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2e.live_server import wait_until
from gateway_testlib import ADMIN, bearer, engine_of, make_gateway, settings_for

from loraplex.platform.api.server import Server
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.settings import ServerLimits

WRITE_TIMEOUT_S = 1
RSS_BOUND_BYTES = 100 << 20
"""A stalled reader of n=16 long completions may cost the server at most this much memory."""


@dataclass
class Live:
    url: str
    engine: AsyncEngine
    mallory: str
    """A tenant limited to one request at a time."""
    alice: str

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def live(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("hostile-clients")
    # Room for 16 sequences of 2,000 tokens: the stalled reader's request could run that long.
    config = EngineConfig(model=str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=2200)
    engine = AsyncEngine(LLMEngine(config))
    limits = ServerLimits(stream_write_timeout_s=WRITE_TIMEOUT_S)
    settings = settings_for(tmp, f"sqlite+aiosqlite:///{tmp / 'g.db'}", limits=limits)
    # A small send buffer on the listening socket (connections inherit it): a stalled reader
    # blocks the server's writes after a few kilobytes, not after the kernel's 4 MiB.
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    listener.bind(("127.0.0.1", 0))
    port = int(listener.getsockname()[1])
    server = Server(make_gateway(engine, settings), "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=server.run, args=([listener],), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=url, headers=ADMIN, timeout=60) as admin:
        keys = {}
        for name, quotas in (("mallory", {"max_concurrency": 1}), ("alice", {})):
            assert admin.post("/admin/api/tenants", json={"name": name, **quotas}).status_code == 201
            keys[name] = admin.post(f"/admin/api/tenants/{name}/keys", json={}).json()["key"]
    try:
        yield Live(url, engine, keys["mallory"], keys["alice"])
    finally:
        server.stop()
        thread.join(60)
        engine.shutdown()


def _raw_request(
    live: Live, path: str, body: dict[str, object], key: str, rcvbuf: int = 4096
) -> socket.socket:
    """Send a whole request on a socket with a tiny receive buffer, and read nothing back."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window
    sock.connect(live.host_port)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def test_a_stalled_stream_reader_is_aborted_and_costs_bounded_memory(live: Live) -> None:
    """Class 1: a client that opens n=16 long streams and never reads. The engine's outputs for it
    coalesce (a backlog of one per request), the write times out after ``stream_write_timeout_s``,
    the request is aborted, its concurrency slot freed: the same tenant (max_concurrency=1) is
    served again, with the socket still open."""
    inner = engine_of(live.engine)
    before = _rss_bytes()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2000, "n": 16, "stream": True, "logprobs": 5}
    body |= {"ignore_eos": True, "temperature": 1.0}
    sock = _raw_request(live, "/v1/completions", body, live.mallory)
    try:
        wait_until(lambda: live.engine.stats.num_running > 0, 30, "the stalled request to start")
        started = time.monotonic()
        # The slot frees within the write timeout (plus the time to fill the socket's buffers).
        freed_s = wait_until(
            lambda: live.engine.stats.num_running == 0, WRITE_TIMEOUT_S + 10, "the stalled request aborted"
        )
        grown = _rss_bytes() - before
        assert grown < RSS_BOUND_BYTES, f"+{grown >> 20} MiB for one stalled reader"
        assert not inner.requests, "the engine still holds the stalled request"
        with httpx.Client(base_url=live.url, timeout=30) as client:
            again = client.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                headers=bearer(live.mallory),
            )
        assert again.status_code == 200, again.text  # the slot is free while the socket is open
        assert time.monotonic() - started < WRITE_TIMEOUT_S + 10, freed_s
    finally:
        sock.close()
