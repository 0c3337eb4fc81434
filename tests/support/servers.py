"""Real uvicorn servers on loopback, in a background thread of the test process.

start_server(engine, name)        a single-tenant server of one ``LLMEngine`` (``LiveServer``)
start_ui_server(engine, settings) the gateway with its admin UI (``UIServer``)
sse_lines, stream_text            reading a streamed answer
wait_until(predicate, ...)        polling

The tests then talk to it over a real socket (disconnects need one) and can still
read the engine's state (free blocks, adapter pins) directly.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from loraplex.adapters import LoRARequest
from loraplex.cli.server_app import build_server_app
from loraplex.platform.api.server import Server
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.settings import ServerLimits, ServerSettings
from support.ports import free_port


@dataclass
class LiveServer:
    """A started server; ``stop()`` returns its exit code."""

    url: str
    engine: LLMEngine
    async_engine: AsyncEngine
    server: Server
    thread: threading.Thread
    exit_codes: list[int] = field(default_factory=list)

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)

    def wait_exit(self, timeout_s: float) -> int | None:
        self.thread.join(timeout_s)
        return self.exit_codes[0] if self.exit_codes else None

    def stop(self) -> int | None:
        self.server.stop()
        return self.wait_exit(60)


def start_server(
    engine: LLMEngine,
    name: str,
    loras: Mapping[str, LoRARequest] | None = None,
    limits: ServerLimits | None = None,
) -> LiveServer:
    async_engine = AsyncEngine(engine)
    settings = ServerSettings(served_model_name=name, single_tenant=True, limits=limits or ServerLimits())
    app = build_server_app(async_engine, settings, loras)
    port = free_port()
    server = Server(app, "127.0.0.1", port, log_level="warning")
    live = LiveServer(f"http://127.0.0.1:{port}", engine, async_engine, server, threading.Thread())
    live.thread = threading.Thread(target=lambda: live.exit_codes.append(server.run()), daemon=True)
    live.thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert live.thread.is_alive(), "the server thread exited during start-up"
        assert time.monotonic() < deadline, "the server did not start in 60 s"
        time.sleep(0.05)
    return live


def sse_lines(response: httpx.Response) -> Iterator[str]:
    """The ``data:`` payloads of a streamed response."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def stream_text(lines: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """Concatenated text of choice 0 (chat or completions) and the error events, if any."""
    text, errors = [], []
    for payload in lines:
        if payload == "[DONE]":
            continue
        body = json.loads(payload)
        if "error" in body:
            errors.append(body["error"])
            continue
        for choice in body["choices"]:
            if choice["index"] == 0:
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text), errors


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``predicate`` until true; return the seconds it took."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - start


@dataclass
class UIServer:
    url: str
    server: Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(60)


def start_ui_server(engine: AsyncEngine, settings: ServerSettings) -> UIServer:
    """Serve the app on a free loopback port; the server shuts ``engine`` down when stopped."""
    app = build_server_app(engine, settings)
    port = free_port()
    server = Server(app, "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive(), "the server thread exited during start-up"
        assert time.monotonic() < deadline, "the server did not start in 120 s"
        time.sleep(0.05)
    return UIServer(f"http://127.0.0.1:{port}", server, thread)
