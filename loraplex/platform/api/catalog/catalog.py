"""Adapter uploads and deletions: the store's files, the database rows and the engine kept in step.

    upload(tenant, files, staging, name, visibility)   validate -> publish -> register + commit
    delete(owner, name[, version])                     delete rows -> unload -> remove unreferenced files
    forget(refs)                                       the same cleanup for rows already deleted
                                                       (a deleted tenant's adapters)
    newest(tenant)                                     the newest version of each of its names

A failed upload leaves nothing: validation happens in a staging folder inside the store (the
caller removes it), and a version published for a commit that then fails is removed again
unless another row references it. Publishing, committing and removing run under the
catalog's ``publishing`` lock, so a folder is never removed while another upload is about to
commit it. The HTTP routes, the admin UI and the operators' CLI all use this (the CLI without
an engine).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from pathlib import Path

from loraplex.adapters.store import AdapterStore
from loraplex.adapters.uploads import AdapterValidator, UploadedFile
from loraplex.platform.api.catalog.engine_adapters import EngineAdapters
from loraplex.platform.api.services import adapters
from loraplex.platform.api.services.adapters import AdapterRef, NewAdapter
from loraplex.platform.api.services.errors import InvalidInput
from loraplex.platform.api.services.names import check_adapter_name
from loraplex.storage.db import VISIBILITIES, Adapter, Database, Tenant, Visibility

logger = logging.getLogger(__name__)


def parse_visibility(value: str) -> Visibility:
    for visibility in VISIBILITIES:
        if value == visibility:
            return visibility
    raise InvalidInput("visibility", f"must be one of {', '.join(VISIBILITIES)}")


class AdapterCatalog:
    """What tenants and operators do to adapters, over one database and one store."""

    def __init__(
        self,
        db: Database,
        store: AdapterStore,
        validator: AdapterValidator | None = None,
        base_model: str = "",
        engine_adapters: EngineAdapters | None = None,
        executor: Executor | None = None,
    ) -> None:
        """``validator`` and ``base_model`` are needed to upload; deleting works without them.
        ``executor`` runs validation (default: asyncio's shared pool; the gateway gives its own,
        bounded one, so uploads never wait on or starve the tokenizer's threads)."""
        self.executor = executor
        self.db = db
        self.store = store
        self.validator = validator
        self.base_model = base_model
        self.engine_adapters = engine_adapters
        self.publishing = asyncio.Lock()
        """Held around publish + commit and around removals, so a folder another upload is about
        to commit is never removed as unreferenced."""
        self.on_change: Callable[[str, str], Awaitable[None]] | None = None
        """Called with (owner, name) after a version of an adapter was committed or deleted (the
        gateway tells the other replicas); None: nobody is told."""

    async def upload(
        self,
        tenant: Tenant,
        uploaded: dict[str, UploadedFile],
        staging: Path,
        name: str,
        visibility: Visibility | None,
    ) -> Adapter:
        """Validate the uploaded files and register them as the newest version of ``name``.

        Raises ``AdapterValidationError`` (the rule the files break), ``InvalidInput``,
        ``QuotaExceeded`` or ``Conflict`` (from the services); the caller removes ``staging``.
        """
        if self.validator is None:
            raise RuntimeError("this AdapterCatalog has no validator; it can only delete")
        check_adapter_name(name)
        if name == self.base_model:
            raise InvalidInput(
                "name", f"'{name}' is the served model's name, so the adapter could never be selected"
            )
        loop = asyncio.get_running_loop()
        facts = await loop.run_in_executor(self.executor, self.validator.validate, uploaded, staging)
        new = NewAdapter(
            name=name,
            version=facts.version,
            base_model=self.base_model,
            rank=facts.rank,
            target_modules=tuple(facts.target_modules),
            nbytes=facts.nbytes,
            path=facts.version,
            visibility=visibility,
        )
        async with self.publishing:
            created = self.store.publish(facts.folder, facts.version)
            try:
                async with self.db.transaction(write=True) as session:
                    adapter = await adapters.register_adapter(session, tenant, new)
            except BaseException:
                if created:
                    await self._remove_unreferenced(new.path)
                raise
        logger.info("tenant %s uploaded adapter %s version %s", tenant.name, name, facts.version[:12])
        if self.on_change is not None:
            await self.on_change(tenant.name, name)
        return adapter

    async def newest(self, tenant: Tenant) -> list[Adapter]:
        """The newest version of each of ``tenant``'s adapters, by name."""
        async with self.db.transaction() as session:
            return await adapters.list_newest(session, tenant)

    async def delete(self, owner: Tenant, name: str, version: str | None = None) -> list[AdapterRef]:
        """Delete one version of ``owner``'s adapter, or all of them; ``NotFound`` if none matches."""
        async with self.publishing:
            async with self.db.transaction(write=True) as session:
                refs = await adapters.delete_adapter(session, owner, name, version)
            await self._forget_locked(refs)
        if self.on_change is not None:
            await self.on_change(owner.name, name)
        return refs

    async def forget(self, refs: list[AdapterRef]) -> None:
        """Unload and remove the files of adapter versions whose rows are gone already."""
        async with self.publishing:
            await self._forget_locked(refs)

    async def _forget_locked(self, refs: list[AdapterRef]) -> None:
        for ref in refs:
            if self.engine_adapters is not None:
                await self.engine_adapters.unload_version(ref.owner, ref.name, ref.version)
        for path in sorted({ref.path for ref in refs}):
            await self._remove_unreferenced(path)

    async def sweep(self, min_age_s: float = 3600.0) -> list[str]:
        """Remove stored versions no row references (a deletion interrupted half-way, an old bug),
        older than ``min_age_s`` (a younger one may be another replica's upload about to commit)."""
        removed = []
        async with self.publishing:
            for version in self.store.versions_older_than(min_age_s):
                async with self.db.transaction() as session:
                    referenced = await adapters.is_path_referenced(session, version)
                if not referenced:
                    self.store.remove(version)
                    removed.append(version)
        if removed:
            logger.warning("removed %d stored adapter version(s) that no row references", len(removed))
        return removed

    async def _remove_unreferenced(self, path: str) -> None:
        async with self.db.transaction() as session:
            referenced = await adapters.is_path_referenced(session, path)
        if not referenced:
            self.store.remove(path)
