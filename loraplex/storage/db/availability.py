"""Whether the database answers: ``DatabaseUnavailable``, the errors that mean it, and an outage gate.

A database restart, a failover or a network blip is routine: the gateway must answer "try
again" (503 + ``Retry-After``) for what needs the database, not a 500, and must not make every
request wait for a dead server. ``Database.transaction()`` is the one place that turns the
driver's "not there now" errors into ``DatabaseUnavailable``; ``DatabaseHealth`` remembers the
outage, so while it lasts one call per ``probe_interval_s`` tries the database and the others
fail at once (a paused server, whose connections hang, costs one timeout per interval, not one
per request). The first call that succeeds ends the outage: pooled connections are checked
before use (pre-ping), so no restart is needed.

| error | means |
|---|---|
| ``sqlalchemy.exc.OperationalError`` | connection refused / lost, server shutting down, SQLite locked |
| ``sqlalchemy.exc.InterfaceError`` | the driver's connection is closed or broken |
| a ``DBAPIError`` with ``connection_invalidated`` | SQLAlchemy saw the connection die |
| ``sqlalchemy.exc.TimeoutError`` | no pooled connection came free within the pool timeout |
| ``TimeoutError`` | connect or statement timeout (asyncpg's ``timeout`` / ``command_timeout``) |
| ``OSError`` | the socket: refused, reset, unreachable |
| asyncpg's connection, interface, cannot-connect-now and shutdown errors | the same, raw |

Anything else (an integrity error, a bug) is not an outage and propagates unchanged.
"""

from __future__ import annotations

import logging
import math
import time

import asyncpg
from sqlalchemy import exc as sa_exc

logger = logging.getLogger(__name__)

DEFAULT_PROBE_INTERVAL_S = 1.0

_RAW_UNAVAILABLE: tuple[type[BaseException], ...] = (
    TimeoutError,
    OSError,
    sa_exc.TimeoutError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
)


class DatabaseUnavailable(Exception):
    """The database cannot be reached now (or did not answer in time); retry after ``retry_after_s``."""

    def __init__(self, reason: str, retry_after_s: int = 1) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` means the database is not there now (see the module's table).

    The driver's error may be wrapped twice: SQLAlchemy's ``DBAPIError`` holds its asyncpg
    adapter's generic ``Error`` (``orig``), caused by the asyncpg exception that says what
    happened (``connection was closed in the middle of operation``). The chain is followed.
    """
    current: BaseException | None = exc
    for _ in range(8):
        if current is None:
            return False
        if isinstance(current, DatabaseUnavailable | sa_exc.OperationalError | sa_exc.InterfaceError):
            return True
        if isinstance(current, sa_exc.DBAPIError) and current.connection_invalidated:
            return True
        if isinstance(current, _RAW_UNAVAILABLE):
            return True
        wrapped = current.orig if isinstance(current, sa_exc.DBAPIError) else None
        current = wrapped if wrapped is not None else current.__cause__
    return False


def describe(exc: BaseException) -> str:
    """A short, secret-free description of a driver error (a URL or password is never in it)."""
    inner = exc.orig if isinstance(exc, sa_exc.DBAPIError) and exc.orig is not None else exc
    text = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
    name = type(inner).__name__
    return f"{name}: {text}"[:200] if text else name


class DatabaseHealth:
    """Outage state of one database: when it started, what failed, counters for metrics."""

    def __init__(self, probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S) -> None:
        self.probe_interval_s = probe_interval_s
        self.down_since_s: float | None = None
        """``time.monotonic()`` of the first failure of the current outage; None while it answers."""
        self.last_error = ""
        """What the last failure was (``describe``); kept after the outage for the logs."""
        self.num_errors = 0
        """Calls that failed, or were refused at once, because the database was unavailable."""
        self.num_outages = 0
        self._next_probe_s = 0.0

    @property
    def down(self) -> bool:
        return self.down_since_s is not None

    def check(self) -> None:
        """Pass while the database answers, and for one call per probe interval during an outage;
        ``DatabaseUnavailable`` at once for the others."""
        if self.down_since_s is None:
            return
        now_s = time.monotonic()
        if now_s < self._next_probe_s:
            self.num_errors += 1
            raise self.unavailable()
        self._next_probe_s = now_s + self.probe_interval_s

    def unavailable(self) -> DatabaseUnavailable:
        """The error to raise during the current outage."""
        since = "" if self.down_since_s is None else f" for {time.monotonic() - self.down_since_s:.0f} s"
        return DatabaseUnavailable(
            f"The metadata database is unreachable{since} ({self.last_error}); retry shortly.",
            retry_after_s=max(1, math.ceil(self.probe_interval_s)),
        )

    def failed(self, exc: BaseException) -> DatabaseUnavailable:
        """Record a failure; the ``DatabaseUnavailable`` to raise instead of ``exc``."""
        self.num_errors += 1
        self.last_error = describe(exc)
        now_s = time.monotonic()
        self._next_probe_s = now_s + self.probe_interval_s
        if self.down_since_s is None:
            self.down_since_s = now_s
            self.num_outages += 1
            logger.warning(
                "the metadata database is unreachable (%s); requests that need it get 503 until it answers",
                self.last_error,
            )
        return self.unavailable()

    def succeeded(self) -> None:
        """A call reached the database: an outage, if any, is over."""
        if self.down_since_s is not None:
            logger.warning(
                "the metadata database answers again after %.1f s", time.monotonic() - self.down_since_s
            )
            self.down_since_s = None
