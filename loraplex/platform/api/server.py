"""Running the app under uvicorn until a signal, or until the engine dies."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from loraplex.platform.api.state import app_state

logger = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    """uvicorn with a hook run at the end of its graceful shutdown (lifespan included).

    After shutting down for SIGTERM, uvicorn raises the signal again from inside
    ``run()``; its default action ends the process there, so code after ``run()`` never
    runs. What must happen on every graceful stop (the engine persisting its cached KV
    to the disk tier for a warm restart) goes in ``after_shutdown``.
    """

    def __init__(self, config: uvicorn.Config, after_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._after_shutdown = after_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().shutdown(sockets=sockets)
        finally:
            # Blocking on purpose: nothing else runs in the loop any more, and the signal
            # must not be re-raised before the KV is on disk.
            self._after_shutdown()


class Server:
    """uvicorn serving an app from ``build_app``; stops by itself if the engine dies.

    ``run()`` blocks and returns the process exit code: 0 after ``stop()``, 1 if the
    engine died (``/health`` answers 503 meanwhile and open requests get an error). On
    SIGTERM/SIGINT, open requests get ``ServerLimits.graceful_shutdown_s`` to finish,
    then uvicorn raises the signal again with its default handler, so the process ends
    the way that signal ends it (SIGTERM: status 143, SIGINT: ``KeyboardInterrupt``).
    The engine shuts down (persisting cached KV to the disk tier) before that, at the
    end of uvicorn's shutdown.
    """

    def __init__(self, app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
        self.state = app_state(app)
        self.uvicorn = _Uvicorn(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                log_level=log_level,
                timeout_graceful_shutdown=self.state.limits.graceful_shutdown_s,
            ),
            after_shutdown=self.state.engine.shutdown,
        )
        self.state.engine.on_dead(self._engine_died)

    @property
    def started(self) -> bool:
        """True once the socket is bound and requests are served."""
        return bool(self.uvicorn.started)

    def run(self) -> int:
        try:
            self.uvicorn.run()
        finally:
            self.state.engine.shutdown()  # idempotent: covers a failed start-up and SIGINT
        return 1 if self.state.engine.error is not None else 0

    def stop(self) -> None:
        """Ask the server to stop (from any thread); ``run()`` returns once it has."""
        self.uvicorn.should_exit = True  # uvicorn polls this flag every 0.1 s

    def _engine_died(self, error: BaseException) -> None:
        logger.error("stopping the server: the engine failed (%r)", error)
        self.stop()


def serve(app: FastAPI, host: str, port: int, log_level: str = "info") -> int:
    """Serve ``app`` until SIGINT/SIGTERM, or until the engine fails (then return 1)."""
    return Server(app, host, port, log_level).run()
