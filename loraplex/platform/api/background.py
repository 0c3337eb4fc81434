"""Work that must finish after a response without delaying it: settling quotas, writing usage.

Tasks are held here (a task nobody references can be garbage-collected mid-flight) and
drained at shutdown, so the last requests' usage reaches the database.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger(__name__)


class BackgroundWork:
    """A set of fire-and-forget tasks that logs their failures and can be drained."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self.num_failed = 0

    def spawn(self, work: Coroutine[Any, Any, None], what: str) -> None:
        task = asyncio.get_running_loop().create_task(work, name=what)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.num_failed += 1
            logger.error("background work %s failed", task.get_name(), exc_info=task.exception())

    @property
    def num_pending(self) -> int:
        return len(self._tasks)

    async def drain(self, timeout_s: float) -> None:
        """Wait for the pending tasks (at most ``timeout_s``), then cancel what is left."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            logger.warning("%d background task(s) cancelled at shutdown", len(pending))
