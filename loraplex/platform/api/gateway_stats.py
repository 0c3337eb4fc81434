"""``GatewayStats``: the gateway's own counters at one moment, what ``/metrics`` reads of it.

Its own module so that the metrics depend on this value type (and a callable that returns it),
never on the ``Gateway`` that fills it in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayStats:
    """The gateway's own counters at one moment (the engine's are ``EngineStats``). They live on
    the event loop, so a snapshot taken there is consistent without a lock."""

    num_usage_write_failures: int
    """Usage records that could not be written (logged each time)."""
    num_background_pending: int
    num_background_failed: int
    quota_backend: str
    """``redis`` or ``local``."""
    quota_backend_down: bool
    """Redis for quotas is unreachable now (always False for the in-process limiter)."""
    num_quota_backend_failures: int
    num_quota_backend_outages: int
    database_down: bool
    """The metadata database is unreachable now (the last call that tried failed)."""
    num_database_errors: int
    """Calls that failed, or were answered 503 at once, because the database was unreachable."""
    num_database_outages: int
    num_auth_cache_hits: int
    """Authentications served from the cache within its TTL (no database round trip)."""
    num_auth_cache_outage_hits: int
    """Authentications (and adapter resolutions) served from the caches because the database was
    unreachable."""
    num_usage_pending: int
    """Usage records waiting in the buffer for the database."""
    num_usage_dropped: int
    """Usage records lost: the buffer was full, or shutdown could not write them (logged)."""
    num_quota_refusals: int = 0
    """Requests and uploads refused by a quota (429 / 503); no usage row is written for them."""
