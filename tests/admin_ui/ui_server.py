"""The gateway (tiny LoRA model, SQLite) served by uvicorn on loopback in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

from loraplex.platform.api.app import build_app
from loraplex.platform.api.server import Server
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.settings import ServerSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    app = build_app(engine, settings)
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
