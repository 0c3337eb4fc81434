"""Usage records on their way to the database: a bounded in-process buffer and one writer.

A request's usage is billing data: a database outage must delay it, not lose it. ``add`` never
waits and never raises; one writer task takes the records in batches (one transaction each)
and, while the database is unreachable (``DatabaseUnavailable``), keeps them and tries again
(``retry_s``, doubling up to ``max_retry_s``). The buffer holds at most ``capacity`` records:
beyond it a record is dropped, counted (``num_dropped``) and logged once per episode (the
buffer filled; the next episode starts when it has drained). ``flush`` at shutdown writes
what is left, for at most its timeout, and logs what it could not.

A record the database refuses (its tenant was deleted meanwhile, an invalid value) is not
retried: it is counted in ``num_failed`` and logged, and the rest of its batch is written. Any
other error is retried ``_ATTEMPTS`` times, then its batch is dropped (counted, logged): an
error that is not an outage may be a bug, which retrying forever would turn into a stuck writer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from itertools import islice

from loraplex.platform.api.services import usage
from loraplex.platform.api.services.errors import ServiceError
from loraplex.storage.db import Database, DatabaseUnavailable, Tenant

logger = logging.getLogger(__name__)

_BATCH = 500
_ATTEMPTS = 3


@dataclass(frozen=True)
class _Pending:
    tenant: Tenant
    record: usage.Usage


class UsageBuffer:
    """Usage records waiting for the database (see the module docstring)."""

    def __init__(self, db: Database, capacity: int, retry_s: float = 0.5, max_retry_s: float = 5.0) -> None:
        self.db = db
        self.capacity = capacity
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self._pending: deque[_Pending] = deque()
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._overflowing = False
        self.num_written = 0
        self.num_dropped = 0
        """Records lost because the buffer was full (or still held when shutdown gave up)."""
        self.num_failed = 0
        """Records the database refused (tenant deleted, invalid value); logged each."""

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        """Start the writer (on the running event loop)."""
        self._writer = asyncio.get_running_loop().create_task(self._write_forever(), name="usage writer")

    def add(self, tenant: Tenant, record: usage.Usage) -> None:
        """Queue one record; never waits, never raises."""
        if len(self._pending) >= self.capacity:
            self.num_dropped += 1
            if not self._overflowing:
                self._overflowing = True
                logger.error(
                    "the usage buffer is full (%d records waiting for the database): usage records are "
                    "dropped until it drains, counted in num_usage_dropped",
                    len(self._pending),
                )
            return
        self._pending.append(_Pending(tenant, record))
        self._wake.set()

    async def written(self, timeout_s: float) -> bool:
        """Wait until every record queued so far is in the database (the writer keeps running);
        False if some are still pending after ``timeout_s``. For readers that must see them all."""
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self._pending

    async def flush(self, timeout_s: float) -> None:
        """Write what is pending, trying for at most ``timeout_s``, and stop the writer."""
        deadline = time.monotonic() + timeout_s
        if self._writer is not None:
            # The writer drains the buffer itself; cancelling it mid-commit could write a batch twice.
            while self._pending and time.monotonic() < deadline and not self._writer.done():
                await asyncio.sleep(0.05)
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
            self._writer = None
        while self._pending and time.monotonic() < deadline:  # a writer never started, or died
            try:
                await asyncio.wait_for(self._write_batch(), max(0.01, deadline - time.monotonic()))
            except (DatabaseUnavailable, TimeoutError):
                await asyncio.sleep(min(self.retry_s, max(0.0, deadline - time.monotonic())))
        if self._pending:
            self.num_dropped += len(self._pending)
            logger.error(
                "%d usage record(s) could not be written before shutdown (the database is unreachable)",
                len(self._pending),
            )
            self._pending.clear()

    async def _write_forever(self) -> None:
        delay_s = self.retry_s
        errors = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                try:
                    await self._write_batch()
                except DatabaseUnavailable:
                    await asyncio.sleep(delay_s)
                    delay_s = min(2 * delay_s, self.max_retry_s)
                    continue
                except Exception:
                    errors += 1
                    if errors < _ATTEMPTS:
                        logger.warning("could not write usage records (will retry)", exc_info=True)
                        await asyncio.sleep(delay_s)
                        continue
                    lost = min(_BATCH, len(self._pending))
                    for _ in range(lost):
                        self._pending.popleft()
                    self.num_failed += lost
                    logger.exception("could not write %d usage record(s); they are dropped", lost)
                errors = 0
                delay_s = self.retry_s

    async def _write_batch(self) -> None:
        """Write the oldest records in one transaction; on success they leave the buffer."""
        batch = list(islice(self._pending, _BATCH))
        refused = 0
        async with self.db.transaction() as session:
            for item in batch:
                try:
                    async with session.begin_nested():
                        await usage.record_usage(session, item.tenant, item.record)
                except ServiceError as exc:  # this record only: the savepoint undid it
                    refused += 1
                    logger.warning("usage of request %s not recorded: %s", item.record.request_id, exc)
        # Only the writer removes records (``add`` appends on the right): the batch is the left end.
        for _ in batch:
            self._pending.popleft()
        self.num_written += len(batch) - refused
        self.num_failed += refused
        if not self._pending:
            self._overflowing = False
