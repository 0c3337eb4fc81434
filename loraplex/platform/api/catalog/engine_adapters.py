"""Which adapter versions this process has registered in the engine, and under which ids.

An adapter version is loaded on its first request (``ensure``), from the content-addressed
store, under ``int_id`` = its database id: unique across tenants and versions, and the same on
every replica. Its engine name is ``owner/name@version12#id``, so two versions of one name are
two engine adapters and a request in flight finishes on the version it started with. The
engine serves the store's folder in place (its name is its content's sha256: reading it checks
it), so nothing is copied again.

An id the engine holds for something else is a stale registration: SQLite hands the id of a
deleted newest row out again, and another process may have deleted it. The stale one is
removed (its running requests drain) and the adapter registered again.

When a newer version of a name is first used here, or a version is deleted through this
process, the older one is unloaded (running requests drain, new ones go to the new version).
Every change goes through ``AsyncEngine``: files are read in a worker thread, and the engine
thread registers and removes adapters between steps.
"""

from __future__ import annotations

import asyncio
import logging

from loraplex.adapters import AdapterError, AdapterExistsError, LoRARequest
from loraplex.adapters.store import AdapterStore
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.errors import AdapterUnavailableError
from loraplex.storage.db import Adapter

logger = logging.getLogger(__name__)

NameKey = tuple[str, str]
"""(owner tenant, adapter name)."""


class EngineAdapters:
    """The gateway's view of the engine's adapter registry (this process only)."""

    def __init__(self, engine: AsyncEngine, store: AdapterStore, shared_tenant: str | None = None) -> None:
        self.engine = engine
        self.store = store
        self.shared_tenant = shared_tenant
        self._loaded: dict[int, LoRARequest] = {}
        self._current: dict[NameKey, int] = {}  # the newest loaded version of each name
        self._versions: dict[tuple[str, str, str], int] = {}  # (owner, name, version) -> int_id
        self._lock = asyncio.Lock()

    @staticmethod
    def engine_name(adapter: Adapter) -> str:
        return f"{adapter.owner.name}/{adapter.name}@{adapter.version[:12]}#{adapter.id}"

    def served_name(self, adapter: Adapter) -> str:
        """How clients name it in ``model`` (what metrics and KV events show routers): its owner's
        name for it if private, ``owner/name`` if public, the bare name for the shared tenant's."""
        if adapter.visibility == "private" or adapter.owner.name == self.shared_tenant:
            return adapter.name
        return f"{adapter.owner.name}/{adapter.name}"

    async def ensure(self, adapter: Adapter) -> LoRARequest:
        """The ``LoRARequest`` of this adapter version, registered in the engine on first use."""
        lora = self._loaded.get(adapter.id)
        if lora is not None:
            return lora
        async with self._lock:  # one registration at a time: two first requests load it once
            lora = self._loaded.get(adapter.id)
            if lora is not None:
                return lora
            lora = LoRARequest(self.engine_name(adapter), adapter.id, str(self.store.path_of(adapter.path)))
            owner = adapter.owner.name
            try:
                try:
                    await self.engine.add_lora(lora, owner, self.served_name(adapter))
                except AdapterExistsError:
                    logger.info("adapter id %d is registered for something else; replacing it", adapter.id)
                    await self._remove(adapter.id)
                    await self.engine.add_lora(lora, owner, self.served_name(adapter))
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
                    await self._unload(previous)
            return lora

    async def unload_version(self, owner: str, name: str, version: str) -> None:
        """Forget a deleted version: requests running on it finish, new ones cannot start.
        A version this process never loaded (after a restart, every one) has nothing to unload."""
        int_id = self._versions.get((owner, name, version))
        if int_id is None:
            return
        await self._unload(int_id)
        if self._current.get((owner, name)) == int_id:
            del self._current[(owner, name)]

    async def unload_name(self, owner: str, name: str) -> None:
        """Forget every version of ``owner``'s ``name`` this process loaded (another replica changed
        or deleted it): running requests finish, the next one loads what the database says."""
        async with self._lock:
            for int_id in {i for (o, n, _), i in self._versions.items() if (o, n) == (owner, name)}:
                await self._unload(int_id)
            self._current.pop((owner, name), None)

    async def unload_owner(self, owner: str) -> None:
        """Forget every version of every adapter of ``owner`` (a tenant deleted elsewhere)."""
        async with self._lock:
            for int_id in {i for (o, _, _), i in self._versions.items() if o == owner}:
                await self._unload(int_id)
            self._current = {key: i for key, i in self._current.items() if key[0] != owner}

    async def _unload(self, int_id: int) -> None:
        lora = self._loaded.pop(int_id, None)
        if lora is None:
            return
        self._versions = {k: v for k, v in self._versions.items() if v != int_id}
        await self._remove(int_id)
        logger.info("unloaded adapter %s (id %d)", lora.name, int_id)

    async def _remove(self, int_id: int) -> None:
        try:
            await self.engine.remove_lora(int_id)
        except AdapterError as exc:  # already gone from the engine: nothing left to free
            logger.debug("adapter id %d was not registered in the engine: %s", int_id, exc)
