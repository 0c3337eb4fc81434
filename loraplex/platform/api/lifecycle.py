"""``Lifecycle``: whether the server is draining for a shutdown, and what it still has in flight.

    SIGTERM -> begin_drain()    /ready answers 503 and new requests 503 (``shutting_down``) at once
            -> num_in_flight    requests already in the server run on, for up to graceful_shutdown_s
            -> the engine stops  the rest end with an error (a stream with its error event)
            -> uvicorn shuts down, then the KV tiers persist

``server.Server`` drives the steps; the ``RequestObserver`` middleware counts the requests in
flight and refuses new ones. Probes (``/health``, ``/ready``, ``/metrics``) are always answered.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.platform.api.errors import SERVER_ERROR, APIError


@dataclass
class Lifecycle:
    """The app's shutdown state; read and written on the event loop (``begin_drain`` from a signal
    handler too: one attribute store)."""

    draining: bool = False
    num_in_flight: int = 0
    """Requests (other than probes) whose response has not ended."""

    def begin_drain(self) -> None:
        self.draining = True


def shutting_down() -> APIError:
    """The answer to a request that arrives while the server drains."""
    return APIError(
        503,
        "The server is shutting down; retry (another replica will answer).",
        code="shutting_down",
        err_type=SERVER_ERROR,
        headers={"Retry-After": "1"},
        reason="shutting_down",
    )
