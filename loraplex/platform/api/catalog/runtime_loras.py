"""``RuntimeLoRAs``: vLLM's runtime adapter loading (``/v1/load_lora_adapter``) on the catalog.

    load(lora_name, lora_path, load_inplace)   -> the adapter row (a new version, or the same)
    unload(lora_name | lora_int_id)            -> the versions removed

What the operator loads becomes a public adapter of the shared tenant (``operator_tenant``,
created on first use), so every tenant may name it by its bare name, as on a vLLM server, and
every replica serves it (the row and the store are shared). ``lora_path`` is either:

- a version already in the adapter store (the 64-hex sha256 ``GET /admin/api/adapters`` shows),
  served in place: nothing is copied;
- a PEFT folder on the server under ``lora_load_root`` (resolved, symlinks followed: one that
  lands outside the root is refused, so the endpoint cannot read arbitrary server files). Its
  two files are copied into a staging folder in a worker thread and validated like an upload.

Errors are the ones vLLM answers (``LoRALoadError``: its ``type`` and status), raised before any
state changes; a failed validation leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path

from loraplex.adapters import AdapterValidationError
from loraplex.adapters.layout import CONFIG_NAME, WEIGHTS_NAME
from loraplex.adapters.uploads import UploadedFile
from loraplex.platform.api.catalog.catalog import AdapterCatalog
from loraplex.platform.api.services import adapters, tenants
from loraplex.platform.api.services.adapters import AdapterRef, NewAdapter
from loraplex.platform.api.services.errors import InvalidInput, NotFound
from loraplex.platform.api.services.names import check_adapter_name
from loraplex.storage.db import Adapter, Database, Tenant

_VERSION = re.compile(r"[0-9a-f]{64}")


class LoRALoadError(Exception):
    """A refusal in vLLM's words: ``InvalidUserInput`` or ``BadRequestError`` (400), ``NotFoundError``
    (404)."""

    def __init__(self, status: int, err_type: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.err_type = err_type
        self.message = message
        self.param = param


def _invalid(message: str, param: str | None = None) -> LoRALoadError:
    return LoRALoadError(400, "InvalidUserInput", message, param)


def _not_found(message: str) -> LoRALoadError:
    return LoRALoadError(404, "NotFoundError", message)


class RuntimeLoRAs:
    """The operator's adapters, loaded and unloaded at run time (see the module docstring)."""

    def __init__(
        self,
        db: Database,
        catalog: AdapterCatalog,
        shared_tenant: str,
        load_root: Path | None,
        max_bytes: int,
    ) -> None:
        self.db = db
        self.catalog = catalog
        self.shared_tenant = shared_tenant
        self.load_root = load_root
        self.max_bytes = max_bytes

    async def load(self, lora_name: str, lora_path: str, load_inplace: bool = False) -> Adapter:
        """Register ``lora_path``'s adapter as the shared tenant's public ``lora_name``."""
        if not lora_name or not lora_path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        try:
            check_adapter_name(lora_name)
        except InvalidInput as exc:
            raise _invalid(f"Invalid 'lora_name': {exc.detail}.", "lora_name") from None
        if lora_name == self.catalog.base_model:
            raise _invalid(
                f"The lora adapter name '{lora_name}' conflicts with a served base model.", "lora_name"
            )
        owner = await self._owner()
        async with self.db.transaction() as session:
            try:
                current = await adapters.get_adapter(session, owner, lora_name)
            except NotFound:
                current = None
        if current is not None and not load_inplace:
            raise _invalid(
                f"The lora adapter '{lora_name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "lora_name",
            )
        if _VERSION.fullmatch(lora_path) and self.catalog.store.path_of(lora_path).is_dir():
            return await self._register_stored(owner, lora_name, lora_path)
        folder = self._folder(lora_path)
        staging = self.catalog.store.new_staging()
        try:
            files = await asyncio.to_thread(self._copy_files, folder, staging)
            try:
                return await self.catalog.upload(owner, files, staging, lora_name, "public")
            except AdapterValidationError as exc:
                raise LoRALoadError(
                    400, "BadRequestError", f"Loading lora {lora_name} failed: {exc.detail}"
                ) from None
        finally:
            self.catalog.store.discard(staging)

    async def unload(self, lora_name: str | None, lora_int_id: int | None = None) -> list[AdapterRef]:
        """Remove the shared tenant's adapter ``lora_name`` (or the one whose id is ``lora_int_id``),
        every version: requests running on it finish, new ones get 404."""
        if not lora_name and not lora_int_id:
            raise _invalid("either 'lora_name' and 'lora_int_id' needs to be provided.")
        owner = await self._owner()
        name = lora_name
        if not name:
            async with self.db.transaction() as session:
                row = await adapters.get_by_id(session, owner, lora_int_id or 0)
            if row is None:
                raise _not_found(f"The lora adapter '{lora_int_id}' cannot be found.")
            name = row.name
        try:
            return await self.catalog.delete(owner, name)
        except NotFound:
            raise _not_found(f"The lora adapter '{name}' cannot be found.") from None

    async def _owner(self) -> Tenant:
        async with self.db.transaction(write=True) as session:
            return await tenants.ensure_tenant(session, self.shared_tenant)

    def _folder(self, lora_path: str) -> Path:
        """``lora_path`` resolved inside ``lora_load_root``; the refusals vLLM gives otherwise."""
        if self.load_root is None:
            raise _invalid(
                "This server loads adapters only from its adapter store (lora_path: a stored version's "
                "sha256); set lora_load_root to load folders from the server's disk.",
                "lora_path",
            )
        root = self.load_root.resolve()
        path = Path(lora_path)
        resolved = (path if path.is_absolute() else root / path).resolve()
        if not resolved.is_relative_to(root):
            raise _invalid(f"lora_path must be a folder under {root} (lora_load_root).", "lora_path")
        if not (resolved / CONFIG_NAME).is_file() or not (resolved / WEIGHTS_NAME).is_file():
            raise _not_found(
                f"No adapter found for {lora_path}: the folder needs {CONFIG_NAME} and {WEIGHTS_NAME}."
            )
        return resolved

    def _copy_files(self, folder: Path, staging: Path) -> dict[str, UploadedFile]:
        """The two files copied into ``staging`` (a worker thread), as an upload's parts."""
        total = sum((folder / name).stat().st_size for name in (CONFIG_NAME, WEIGHTS_NAME))
        if total > self.max_bytes:
            raise _invalid(
                f"The adapter's files take {total} bytes, more than this server accepts ({self.max_bytes})."
            )
        files = {}
        for field, name in (("adapter_config", CONFIG_NAME), ("adapter_model", WEIGHTS_NAME)):
            target = staging / f"part-{field}"
            shutil.copyfile(folder / name, target)
            files[field] = UploadedFile(field, name, target, target.stat().st_size)
        return files

    async def _register_stored(self, owner: Tenant, lora_name: str, version: str) -> Adapter:
        """A version already in the store, registered under ``lora_name`` (its facts from a row)."""
        async with self.db.transaction() as session:
            model = await adapters.find_version(session, version)
        if model is None:
            raise _not_found(f"No adapter found for {version}: no adapter row holds that version.")
        new = NewAdapter(
            name=lora_name,
            version=version,
            base_model=model.base_model,
            rank=model.rank,
            target_modules=tuple(model.target_modules),
            nbytes=model.nbytes,
            path=model.path,
            visibility="public",
        )
        # Under the catalog's lock: no deletion removes the folder while it is being registered.
        async with self.catalog.publishing, self.db.transaction(write=True) as session:
            return await adapters.register_adapter(session, owner, new)
