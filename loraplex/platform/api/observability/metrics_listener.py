"""``MetricsListener``: ``GET /metrics`` on a port of its own (``metrics_port``), without auth.

Routers' endpoint pickers and Prometheus scrape replicas from inside the cluster; on the serving
port, which clients reach, the series (adapter and tenant names among them) are the operator's.
So the same registry is served here too, and nothing else: every other path is a 404, and no
request on this port reaches the gateway, the engine's queue or the access log. The Helm chart
keeps the port out of the Service clients reach and admits only the picker and Prometheus to it
(NetworkPolicy).

It runs in the server's event loop (the app's lifespan starts and stops it), as a second
uvicorn ``Server`` that leaves the process's signal handlers to the main one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Generator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from loraplex.platform.api.observability.metrics import CONTENT_TYPE

logger = logging.getLogger(__name__)

_STOP_S = 5.0


def metrics_app(render: Callable[[], bytes]) -> Starlette:
    """An app that answers ``GET /metrics`` with ``render()`` and 404 to anything else."""

    async def metrics(_: Request) -> Response:
        return Response(render(), media_type=CONTENT_TYPE)

    async def not_found(request: Request, _: Exception) -> Response:
        return PlainTextResponse("only GET /metrics is served on this port\n", status_code=404)

    return Starlette(
        routes=[Route("/metrics", metrics, methods=["GET"])], exception_handlers={404: not_found}
    )


class _Quiet(uvicorn.Server):
    """uvicorn that leaves signals alone: the main server owns them (and stops this one)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class MetricsListener:
    """The metrics port: ``start`` binds it (raising if it cannot), ``stop`` closes it."""

    def __init__(self, render: Callable[[], bytes], host: str, port: int) -> None:
        config = uvicorn.Config(
            metrics_app(render), host=host, port=port, lifespan="off", access_log=False, log_config=None
        )
        self.server = _Quiet(config)
        self.host, self.port = host, port
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen on the metrics port; ``OSError`` naming it if it cannot be bound."""
        # Bound here, not by uvicorn: uvicorn answers a failed bind with sys.exit, which would
        # end the whole event loop (the serving port's too) from inside this task.
        try:
            sock = self.server.config.bind_socket()
        except SystemExit:
            raise OSError(f"metrics_port: cannot listen on {self.host}:{self.port} (in use?)") from None
        self._task = asyncio.create_task(self.server.serve(sockets=[sock]), name="metrics-listener")
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError(f"metrics_port: the listener on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)
        logger.info("metrics (GET /metrics, no auth) on http://%s:%d", self.host, self.port)

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await asyncio.wait_for(self._task, _STOP_S)
