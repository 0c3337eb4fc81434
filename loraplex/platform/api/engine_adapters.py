"""Which adapter versions this process has registered in the engine, and under which ids.

An adapter version is loaded on its first request (``ensure``), from the gateway's store,
under ``int_id`` = its database id: unique across tenants and versions, and the same on every
replica. Its engine name is ``owner/name@version12#id``, so two versions of one name are two
engine adapters and a request in flight finishes on the version it started with.

An id the engine holds for something else is a stale registration: SQLite hands the id of a
deleted newest row out again, and another process may have deleted it. The stale one is
removed (its running requests drain) and the adapter registered again.

When a newer version of a name is first used here, or a version is deleted through this
process, the older one is unloaded (``remove_lora``: running requests drain, new ones go to
the new version). Registration validates and reads the files, so it runs in a worker thread:
the engine's adapter manager takes calls from any thread, and the engine thread never waits
for a disk read.
"""

from __future__ import annotations

import asyncio
import logging

from loraplex.adapters import AdapterError, AdapterExistsError, LoRARequest
from loraplex.platform.api.adapter_files import AdapterFileStore
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.errors import AdapterUnavailableError
from loraplex.storage.db import Adapter

logger = logging.getLogger(__name__)

NameKey = tuple[str, str]
"""(owner tenant, adapter name)."""


class EngineAdapters:
    """The gateway's view of the engine's adapter registry (this process only)."""

    def __init__(self, engine: LLMEngine, files: AdapterFileStore) -> None:
        self.engine = engine
        self.files = files
        self._loaded: dict[int, LoRARequest] = {}
        self._current: dict[NameKey, int] = {}  # the newest loaded version of each name
        self._versions: dict[tuple[str, str, str], int] = {}  # (owner, name, version) -> int_id
        self._lock = asyncio.Lock()

    @staticmethod
    def engine_name(adapter: Adapter) -> str:
        return f"{adapter.owner.name}/{adapter.name}@{adapter.version[:12]}#{adapter.id}"

    async def ensure(self, adapter: Adapter) -> LoRARequest:
        """The ``LoRARequest`` of this adapter version, registered in the engine on first use."""
        lora = self._loaded.get(adapter.id)
        if lora is not None:
            return lora
        async with self._lock:  # one registration at a time: two first requests load it once
            lora = self._loaded.get(adapter.id)
            if lora is not None:
                return lora
            lora = LoRARequest(self.engine_name(adapter), adapter.id, str(self.files.path_of(adapter.path)))
            owner = adapter.owner.name
            try:
                try:
                    await asyncio.to_thread(self.engine.add_lora, lora, owner)
                except AdapterExistsError:
                    logger.info("adapter id %d is registered for something else; replacing it", adapter.id)
                    self.engine.remove_lora(adapter.id)
                    await asyncio.to_thread(self.engine.add_lora, lora, owner)
            except AdapterError as exc:  # the stored files no longer validate: an operator must look
                logger.error("adapter %s (id %d) cannot be loaded: %s", lora.name, lora.int_id, exc)
                raise AdapterUnavailableError(
                    f"The adapter '{adapter.name}' cannot be served right now.", param="model"
                ) from exc
            self._loaded[adapter.id] = lora
            self._versions[(owner, adapter.name, adapter.version)] = adapter.id
            key = (owner, adapter.name)
            previous = self._current.get(key)
            if previous is None or previous < adapter.id:
                self._current[key] = adapter.id
                if previous is not None:
                    self._unload(previous)
            return lora

    def unload_version(self, owner: str, name: str, version: str) -> None:
        """Forget a deleted version: requests running on it finish, new ones cannot start."""
        int_id = self._versions.get((owner, name, version))
        if int_id is not None:
            self._unload(int_id)
        if self._current.get((owner, name)) == int_id:
            del self._current[(owner, name)]

    def _unload(self, int_id: int) -> None:
        lora = self._loaded.pop(int_id, None)
        if lora is None:
            return
        self._versions = {k: v for k, v in self._versions.items() if v != int_id}
        try:
            self.engine.remove_lora(int_id)
        except AdapterError as exc:  # already gone from the engine: nothing left to free
            logger.debug("adapter id %d was not registered in the engine: %s", int_id, exc)
        logger.info("unloaded adapter %s (id %d)", lora.name, int_id)
