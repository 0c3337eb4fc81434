"""Running the app under uvicorn until a signal, or until the engine dies.

A signal (SIGTERM, SIGINT) drains the server before uvicorn shuts down::

    signal          Lifecycle.begin_drain(): /ready 503, new requests 503 (shutting_down), at once
    <= grace        requests in flight run on; the server keeps listening (probes answered)
    grace over      the engine stops: what is still running ends with an error (503 engine_dead,
                    or a stream's error event then [DONE]); nothing is cut without one
    then            uvicorn's own shutdown (connections closed, lifespan), the engine's shutdown
                    (cached KV persisted to the disk tier), and the signal raised again

A second signal skips the rest of the grace (SIGINT twice: uvicorn's force exit). The grace is
``ServerLimits.graceful_shutdown_s``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from loraplex.platform.api.connections import ConnectionGuard, guarded_protocol
from loraplex.platform.api.lifecycle import Lifecycle
from loraplex.platform.api.state import app_state

logger = logging.getLogger(__name__)

_FLUSH_S = 5.0
"""After the grace, how long failed requests get to send their error (then uvicorn cancels)."""
_DRAIN_POLL_S = 0.05


class _Uvicorn(uvicorn.Server):
    """uvicorn that drains on a signal (see the module docstring) and runs a hook at the end of its
    graceful shutdown (lifespan included).

    After shutting down for SIGTERM, uvicorn raises the signal again from inside
    ``run()``; its default action ends the process there, so code after ``run()`` never
    runs. What must happen on every graceful stop (the engine persisting its cached KV
    to the disk tier for a warm restart) goes in ``after_shutdown``.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        lifecycle: Lifecycle,
        grace_s: float,
        stop_engine: Callable[[], None],
        after_shutdown: Callable[[], None],
    ) -> None:
        super().__init__(config)
        self._lifecycle = lifecycle
        self._grace_s = grace_s
        self._stop_engine = stop_engine
        self._after_shutdown = after_shutdown
        self._drain: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._lifecycle.draining or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal: stop waiting
            if sig == signal.SIGTERM:
                self.should_exit = True
            return
        self._captured_signals.append(sig)  # raised again once shut down, as uvicorn does
        self._lifecycle.begin_drain()  # a signal handler: one attribute store, picked up by on_tick

    async def on_tick(self, counter: int) -> bool:
        if self._lifecycle.draining and self._drain is None and not self.should_exit:
            self._drain = asyncio.create_task(self._drain_then_exit())
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        lifecycle = self._lifecycle
        logger.info(
            "shutting down: %d request(s) in flight get up to %.0f s to finish",
            lifecycle.num_in_flight,
            self._grace_s,
        )
        finished = await _wait_for_no_requests(lifecycle, self._grace_s)
        if not finished:
            logger.warning(
                "shutting down: %d request(s) still running after %.0f s end with an error",
                lifecycle.num_in_flight,
                self._grace_s,
            )
            # Off the event loop: the streams' error events go out while the engine stops.
            await asyncio.to_thread(self._stop_engine)
            await _wait_for_no_requests(lifecycle, _FLUSH_S)
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._lifecycle.begin_drain()  # also when stopped without a signal (the engine died)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            # Blocking on purpose: nothing else runs in the loop any more, and the signal
            # must not be re-raised before the KV is on disk.
            self._after_shutdown()


async def _wait_for_no_requests(lifecycle: Lifecycle, timeout_s: float) -> bool:
    """Wait until no request is in flight; False if ``timeout_s`` passed first."""
    deadline = time.monotonic() + timeout_s
    while lifecycle.num_in_flight > 0:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_DRAIN_POLL_S)
    return True


class Server:
    """uvicorn serving an app from ``build_app``; stops by itself if the engine dies.

    ``run()`` blocks and returns the process exit code: 0 after ``stop()``, 1 if the
    engine died (``/health`` answers 503 meanwhile and open requests get an error). On
    SIGTERM/SIGINT the server drains (module docstring): requests in flight get
    ``ServerLimits.graceful_shutdown_s`` to finish, then uvicorn raises the signal again with
    its default handler, so the process ends the way that signal ends it (SIGTERM: status 143,
    SIGINT: ``KeyboardInterrupt``). The engine shuts down (persisting cached KV to the disk
    tier) before that, at the end of uvicorn's shutdown.
    """

    def __init__(
        self, app: FastAPI, host: str, port: int, log_level: str = "info", access_log: bool = True
    ) -> None:
        self.state = app_state(app)
        serving = self.state.settings.serving
        self.connections = ConnectionGuard.for_process(
            serving.max_connections, serving.header_timeout_s, serving.body_idle_timeout_s, serving.backlog
        )
        """The connection limits (header and body timeouts, max_connections) and their counts."""
        self.uvicorn = _Uvicorn(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                log_level=log_level,
                http=guarded_protocol(self.connections),
                backlog=serving.backlog,
                # X-Forwarded-For is believed only from the listed proxies (uvicorn's default would
                # believe any loopback peer, so a local client could pick its own address).
                proxy_headers=bool(serving.trusted_proxies),
                forwarded_allow_ips=list(serving.trusted_proxies) or None,
                timeout_keep_alive=serving.timeout_keep_alive_s,  # type: ignore[arg-type]
                # The drain already waited for the requests; this bounds the flush of the last bytes.
                timeout_graceful_shutdown=int(_FLUSH_S),
                # The app writes its own JSON access log; uvicorn's would repeat each request.
                access_log=not self.state.settings.serving.access_log and access_log,
            ),
            lifecycle=self.state.lifecycle,
            grace_s=self.state.limits.graceful_shutdown_s,
            stop_engine=self.state.engine.shutdown,
            after_shutdown=self.state.engine.shutdown,
        )
        self.state.engine.on_dead(self._engine_died)

    @property
    def started(self) -> bool:
        """True once the socket is bound and requests are served."""
        return bool(self.uvicorn.started)

    def run(self, sockets: list[socket.socket] | None = None) -> int:
        """Serve until stopped; ``sockets``: listening sockets bound already (socket activation,
        or a socket with its own options), instead of binding ``host:port``."""
        # Everything built so far (torch, transformers, the model, the app) lives as long as the
        # process: out of the cyclic collector's sight, a full collection walks only what requests
        # allocate. Walking all of it held the GIL for hundreds of ms while a large answer was built.
        gc.collect()
        gc.freeze()
        try:
            self.uvicorn.run(sockets=sockets)
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
