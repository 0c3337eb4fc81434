"""Connection limits under uvicorn: what a client that opens sockets and never finishes can hold.

uvicorn's h11 protocol waits for a request's headers and body forever, and accepts every
connection until the process runs out of file descriptors (then nobody is served, and every
failed accept is logged). ``guarded_protocol`` is its protocol with three bounds added:

    header_timeout_s      from the connection (or the first byte of a keep-alive connection's next
                          request) to the end of the headers; past it the connection is closed
    body_idle_timeout_s   a request body that sends nothing for this long: closed (the app hears a
                          disconnect, logged as 499); reset by every chunk, so large uploads pass
    max_connections       open connections; over it, a few milliseconds later (``TRIM_DELAY_S``:
                          the newcomers' requests are read first), every suspect is evicted (part
                          of a request head and then nothing, or idle without ever completing a
                          request), then as few served keep-alive connections as it takes, oldest
                          first; a new connection past max_connections + backlog evicts the
                          suspects that had their chance, never a served one, or is refused with
                          503 at once

Evicting rather than refusing is what keeps slow-header clients from locking everyone out: they can
only push each other out, while a client that sends its request at once is served. The process's
open-files limit is raised to its hard limit at start (``raise_open_files_limit``), and
``max_connections`` is kept below it with room for the listening backlog (the event loop accepts up
to ``backlog`` connections in one go before the protocol sees them), so accept does not fail for want
of a descriptor.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

TRIM_DELAY_S = 0.05
"""Over max_connections, how long the new connections get to show they are sending a request before
the oldest idle ones are evicted."""
FD_RESERVE = 256
"""Descriptors kept for everything but client connections: the database pool, Redis, log files,
adapter and KV-cache files, the metrics listener."""

_BODY = json.dumps(
    {
        "error": {
            "message": "The server has too many open connections; retry shortly.",
            "type": "server_error",
            "param": None,
            "code": "too_many_connections",
        }
    }
).encode()
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"x-content-type-options: nosniff\r\nretry-after: 1\r\nconnection: close\r\n"
    b"content-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY
)
"""The whole answer to a connection refused at the limit (written before any request is read)."""


def raise_open_files_limit() -> int:
    """Raise this process's soft open-files limit to its hard limit; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # a container may forbid it: keep what we have
            logger.warning("could not raise the open-files limit from %d to %d: %s", soft, target, exc)
    return soft


@dataclass
class ConnectionGuard:
    """The limits, and the connections that may be evicted (oldest first)."""

    max_connections: int
    header_timeout_s: float
    body_idle_timeout_s: float
    burst: int = 0
    """Connections over ``max_connections`` held until the next trim (one accept batch: the
    backlog); past that a new one is refused with 503 at once."""
    trim_scheduled: bool = False
    evictable: dict[Any, float] = field(default_factory=dict)
    """Connections with no request running, oldest first, with the loop time they became so."""
    partial: dict[Any, None] = field(default_factory=dict)
    """Connections that sent part of a request head and no more (the first evicted), oldest first."""
    num_refused: int = 0
    num_evicted: int = 0
    num_timed_out: int = 0

    @classmethod
    def for_process(
        cls, max_connections: int, header_timeout_s: float, body_idle_timeout_s: float, backlog: int
    ) -> ConnectionGuard:
        """The guard for this process: its open-files limit raised, ``max_connections`` kept under it
        with room for two accept batches (``backlog``: one held until a trim, one being accepted) and
        ``FD_RESERVE``."""
        limit = raise_open_files_limit()
        allowed = max(1, limit - FD_RESERVE - 2 * backlog)
        if max_connections > allowed:
            logger.warning(
                "max_connections %d is over what the open-files limit (%d) allows; using %d",
                max_connections,
                limit,
                allowed,
            )
            max_connections = allowed
        return cls(max_connections, header_timeout_s, body_idle_timeout_s, burst=backlog)


def guarded_protocol(guard: ConnectionGuard) -> type[H11Protocol]:
    """uvicorn's h11 protocol under ``guard`` (see the module docstring); pass as ``Config(http=...)``."""

    class GuardedH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        served = False
        """A response was completed on this connection (it is evicted after those never served)."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > guard.max_connections + guard.burst:
                # Full even with a burst: make room by evicting idle connections that had their
                # chance (TRIM_DELAY_S); refuse only when every connection is busy or brand new.
                self._evict(guard.max_connections + guard.burst, self.loop.time() - TRIM_DELAY_S)
                if self._num_open() > guard.max_connections + guard.burst:
                    guard.num_refused += 1
                    transport.write(REFUSAL)
                    transport.close()
                    return
            self._waiting(guard.header_timeout_s)
            if len(self.connections) > guard.max_connections and not guard.trim_scheduled:
                # Not at once: the connections accepted in this batch first get their bytes read, so
                # one that sent its request at once is running it, and is not the one evicted.
                guard.trim_scheduled = True
                self.loop.call_later(TRIM_DELAY_S, self._trim)

        def _trim(self) -> None:
            guard.trim_scheduled = False
            self._evict(guard.max_connections, None)

        def _evict(self, keep: int, since: float | None) -> None:
            """Over ``keep`` open connections: close every suspect, those that sent part of their
            headers and stopped (a client sends a small request's headers in one go) and those
            idle that never completed a request (idle since before ``since``, if given); then, only
            when trimming (``since`` None) and still over, served idle keep-alive connections,
            oldest first, as few as it takes."""
            if self._num_open() <= keep:
                return
            for victim in list(guard.partial):
                self._close(victim)
            for victim, idle_since in list(guard.evictable.items()):
                if not victim.served and (since is None or idle_since <= since):
                    self._close(victim)
            if since is not None:
                return  # making room for a newcomer: never at a served client's cost
            # Counted once: a closed transport leaves self.connections only in connection_lost,
            # on a later loop iteration, so len() would not shrink while closing here.
            excess = self._num_open() - keep
            served = sorted(guard.evictable.items(), key=lambda item: item[1])
            for victim, _ in served[: max(0, excess)]:
                self._close(victim)

        def _num_open(self) -> int:
            return sum(1 for connection in self.connections if not connection.transport.is_closing())

        @staticmethod
        def _close(victim: Any) -> None:
            guard.evictable.pop(victim, None)
            guard.partial.pop(victim, None)
            guard.num_evicted += 1
            victim.transport.close()

        def _waiting(self, timeout_s: float | None) -> None:
            """No request runs: evictable, and closed after ``timeout_s`` (None: uvicorn's keep-alive
            timer decides)."""
            guard.evictable[self] = self.loop.time()
            self._arm(timeout_s)

        def _arm(self, timeout_s: float | None) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if timeout_s is not None:
                self._timer = self.loop.call_later(timeout_s, self._expire)

        def _expire(self) -> None:
            self._timer = None
            guard.num_timed_out += 1
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                guard.evictable.pop(self, None)  # a request runs: never evicted
                guard.partial.pop(self, None)
                self._arm(guard.body_idle_timeout_s if cycle.more_body else None)
            elif not self.transport.is_closing():
                guard.partial[self] = None  # bytes, but not a whole request head yet
                if self._timer is None:
                    # The first bytes of a keep-alive connection's next request: its headers' clock starts.
                    self._waiting(guard.header_timeout_s)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.served = True
            if not self.transport.is_closing():
                self._waiting(None)

        def connection_lost(self, exc: Exception | None) -> None:
            guard.evictable.pop(self, None)
            guard.partial.pop(self, None)
            self._arm(None)
            super().connection_lost(exc)

    return GuardedH11Protocol
