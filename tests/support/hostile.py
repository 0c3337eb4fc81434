"""A live gateway for the hostile-client tests: uvicorn on loopback in a thread of the test
process (keys mode, SQLite), so a test can hold sockets the way a hostile client does (open and
never read, half-sent) and still read the engine's state; four tenants, ``mallory`` limited to
one request at a time. Shared by ``test_hostile_clients`` and ``test_hostile_soak``."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from loraplex.platform.api.server import Server
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.settings import ServerLimits
from support.gateway import ADMIN, make_gateway, settings_for

WRITE_TIMEOUT_S = 1
MAX_SEQUENCES = 24
MAX_RESPONSE_LOGPROBS = 16 * 200 * 21
"""The largest whole answer: n=16, 200 tokens, top_logprobs=20 (about 6 MB of JSON)."""
MAX_CONNECTIONS = 64
HEADER_TIMEOUT_S = 2.0
BACKLOG = 32
STALL_S = 1.0
"""Longest /health may take while a hostile request runs."""
RSS_BOUND_BYTES = 100 << 20
"""A stalled reader of n=16 long completions may cost the server at most this much memory."""


@dataclass
class Live:
    url: str
    engine: AsyncEngine
    mallory: str
    """A tenant limited to one request at a time."""
    alice: str
    others: list[str]
    """Two more tenants without limits."""
    server: Server

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)


def rss_bytes() -> int:
    """This process's resident memory (the gateway runs in it)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def live(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("hostile-clients")
    # Room for 16 sequences of 2,000 tokens: the stalled reader's request could run that long.
    config = EngineConfig(model=str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=2200)
    engine = AsyncEngine(LLMEngine(config))
    limits = ServerLimits(stream_write_timeout_s=WRITE_TIMEOUT_S, max_response_logprobs=MAX_RESPONSE_LOGPROBS)
    settings = settings_for(
        tmp,
        f"sqlite+aiosqlite:///{tmp / 'g.db'}",
        limits=limits,
        max_sequences_per_tenant=MAX_SEQUENCES,
        max_connections=MAX_CONNECTIONS,
        header_timeout_s=HEADER_TIMEOUT_S,
        backlog=BACKLOG,
    )
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
        for name, quotas in (("mallory", {"max_concurrency": 1}), ("alice", {}), ("bob", {}), ("carol", {})):
            assert admin.post("/admin/api/tenants", json={"name": name, **quotas}).status_code == 201
            keys[name] = admin.post(f"/admin/api/tenants/{name}/keys", json={}).json()["key"]
    try:
        yield Live(url, engine, keys["mallory"], keys["alice"], [keys["bob"], keys["carol"]], server)
    finally:
        server.stop()
        thread.join(60)
        engine.shutdown()
