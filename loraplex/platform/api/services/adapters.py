"""The adapter registry's metadata: who owns which adapter, its versions, who may use it.

The files live in the content-addressed adapter store; a row here points at them (``path``).

    register_adapter(owner, NewAdapter)  a new version of a name (quotas checked), or the newest again
    resolve_adapter(caller, model)       the version a request runs on, or AdapterNotFoundError
    list_visible(caller)                 what ``/v1/models`` shows: own names, others' public ones
    delete_adapter(owner, name[, ver])   drop versions; returns what to unload and maybe remove

Rules:
- A name has versions (content sha256); the newest (highest id) is the one served. Uploading
  the content of the newest version again changes nothing; the content of an *older* version
  is a ``Conflict`` (delete the newer versions to go back to it).
- Visibility belongs to the name: registering a version, or ``set_visibility``, sets it on
  every version, so "public" never depends on which version happens to be newest. A version
  registered without one keeps the name's (private for a new name).
- A request names its own adapter ``name`` (or ``own-tenant/name``) and another tenant's
  public one ``owner/name``. Another tenant's private adapter, a disabled tenant's adapter and
  a name that does not exist all give the same ``AdapterNotFoundError.for_model(model)``, so a caller
  cannot learn which names exist.
- The shared tenant (the operator's, ``operator_tenant``: what ``/v1/load_lora_adapter`` loads
  into) is the one exception to ``owner/name``: its public adapters answer to their bare name
  too, for any caller without an adapter of its own by that name, as a vLLM server's loaded
  adapters do. ``/v1/models`` lists them so.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from sqlalchemy import and_, delete, exists, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.adapters import AdapterNotFoundError
from loraplex.platform.api.services.errors import Conflict, InvalidInput, NotFound, QuotaExceeded
from loraplex.platform.api.services.names import check_adapter_name
from loraplex.platform.api.services.pages import Page, PageRequest, decode_cursor, encode_cursor, make_page
from loraplex.storage.db.models import VISIBILITIES, Adapter, Tenant, Visibility

_VERSION = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class NewAdapter:
    """What the upload path learnt about a validated adapter, and where the store put it."""

    name: str
    version: str
    """sha256 hex of the content (``loraplex.adapters.content_version``)."""
    base_model: str
    rank: int
    target_modules: tuple[str, ...]
    nbytes: int
    path: str
    """The files' place in the adapter store, relative to its root."""
    visibility: Visibility | None = "private"
    """None: the name's current visibility (private for a new name)."""


@dataclass(frozen=True)
class AdapterRef:
    """An adapter version that was removed: enough to unload it and to find its files."""

    owner: str
    name: str
    version: str
    path: str

    @classmethod
    def of(cls, adapter: Adapter) -> AdapterRef:
        return cls(owner=adapter.owner.name, name=adapter.name, version=adapter.version, path=adapter.path)


@dataclass(frozen=True)
class AdapterUsage:
    """What a tenant's adapters take, against ``max_adapters`` and ``max_adapter_bytes``."""

    num_adapters: int
    """Distinct names."""
    num_bytes: int
    """All stored versions together."""


def model_name(
    caller: Tenant, adapter: Adapter, shared: str | None = None, own: frozenset[str] = frozenset()
) -> str:
    """How ``caller`` names ``adapter`` in a request: ``name`` if it owns it, or if the shared tenant
    ``shared`` does and ``caller`` has no adapter of that name (``own``: its names); else
    ``owner/name``."""
    if adapter.owner_id == caller.id:
        return adapter.name
    if shared is not None and adapter.owner.name == shared and adapter.name not in own:
        return adapter.name
    return f"{adapter.owner.name}/{adapter.name}"


async def register_adapter(session: AsyncSession, owner: Tenant, new: NewAdapter) -> Adapter:
    """Record a new version of ``owner``'s adapter ``new.name``; it becomes the one served.

    ``QuotaExceeded`` if it would take the owner over ``max_adapters`` (a new name) or
    ``max_adapter_bytes`` (every stored version counts); ``Conflict`` for the content of an
    older version; ``InvalidInput`` for a bad name, version, rank or size.
    """
    # The row lock serialises registrations of one tenant on PostgreSQL, so two uploads at once
    # cannot both pass the quota check (SQLite has one writer at a time: see session.py), and
    # populate_existing reads the quotas as they are now, not as the caller loaded them.
    locked = await session.scalar(
        select(Tenant)
        .where(Tenant.id == owner.id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    if locked is None:
        raise NotFound("tenant", owner.name)
    versions = await _versions(session, owner.id, new.name)
    if new.visibility is None:  # a new version keeps the name's visibility unless it is given
        new = dataclasses.replace(new, visibility=versions[0].visibility if versions else "private")
    _check_new(new)
    assert new.visibility is not None
    if versions and versions[0].version == new.version:
        await _set_visibility(session, owner.id, new.name, new.visibility)
        return versions[0]
    if any(v.version == new.version for v in versions):
        raise Conflict(
            "adapter",
            new.name,
            f"already has version {new.version[:12]} as an older version; delete the newer ones to serve it",
        )
    await _check_quotas(session, locked, is_new_name=not versions, nbytes=new.nbytes)
    await _set_visibility(session, owner.id, new.name, new.visibility)
    adapter = Adapter(
        owner=locked,
        name=new.name,
        version=new.version,
        visibility=new.visibility,
        base_model=new.base_model,
        rank=new.rank,
        target_modules=list(new.target_modules),
        nbytes=new.nbytes,
        path=new.path,
    )
    session.add(adapter)
    try:
        await session.flush()
    except IntegrityError:  # the same version registered concurrently (SQLite, no row lock)
        raise Conflict("adapter", new.name, f"version {new.version[:12]} was just registered") from None
    return adapter


async def resolve_adapter(
    session: AsyncSession, caller: Tenant, model: str, shared: str | None = None
) -> Adapter:
    """The adapter version a request of ``caller`` for ``model`` runs on; ``NotFound`` otherwise.

    ``model`` is ``name`` (the caller's own; else, with ``shared``, that tenant's public one) or
    ``owner/name``. The caller checks first whether ``model`` is the base model's name (which
    may contain a slash itself).
    """
    owner_name, slash, name = model.rpartition("/")
    adapter = await _newest_named(session, owner_name if slash else caller.name, name)
    if adapter is None and not slash and shared is not None and shared != caller.name:
        adapter = await _newest_named(session, shared, name)
    if adapter is None or not _may_use(caller, adapter):
        raise AdapterNotFoundError.for_model(model)
    return adapter


async def _newest_named(session: AsyncSession, owner_name: str, name: str) -> Adapter | None:
    return await session.scalar(
        select(Adapter)
        .join(Tenant, Adapter.owner_id == Tenant.id)
        .where(Tenant.name == owner_name, Adapter.name == name)
        .order_by(Adapter.id.desc())
        .limit(1)
    )


async def find_version(session: AsyncSession, version: str) -> Adapter | None:
    """Some adapter row (of any tenant) that holds content ``version``, or None."""
    return await session.scalar(select(Adapter).where(Adapter.version == version).limit(1))


async def get_by_id(session: AsyncSession, owner: Tenant, adapter_id: int) -> Adapter | None:
    """``owner``'s adapter version with row id ``adapter_id`` (the engine's ``int_id``), or None."""
    adapter = await session.get(Adapter, adapter_id)
    return adapter if adapter is not None and adapter.owner_id == owner.id else None


async def get_adapter(session: AsyncSession, owner: Tenant, name: str) -> Adapter:
    """The newest version of ``owner``'s adapter ``name``; ``NotFound`` otherwise."""
    versions = await _versions(session, owner.id, name)
    if not versions:
        raise NotFound("adapter", name)
    return versions[0]


async def list_versions(session: AsyncSession, owner: Tenant, name: str) -> list[Adapter]:
    """Every stored version of ``owner``'s adapter ``name``, newest first; ``NotFound`` if none."""
    versions = await _versions(session, owner.id, name)
    if not versions:
        raise NotFound("adapter", name)
    return versions


async def list_visible(session: AsyncSession, caller: Tenant) -> list[Adapter]:
    """The newest version of every adapter ``caller`` may use: its own, and others' public ones.

    Ordered by owner name, then adapter name; ``model_name`` gives the name to request each by.
    """
    newest = (
        select(func.max(Adapter.id).label("id")).group_by(Adapter.owner_id, Adapter.name).subquery("newest")
    )
    query = (
        select(Adapter)
        .join(newest, Adapter.id == newest.c.id)
        .join(Tenant, Adapter.owner_id == Tenant.id)
        .where(
            or_(
                Adapter.owner_id == caller.id,
                and_(Adapter.visibility == "public", Tenant.disabled.is_(False)),
            )
        )
        .order_by(Tenant.name, Adapter.name)
    )
    return list(await session.scalars(query))


async def list_adapters(session: AsyncSession, owner: Tenant | None = None) -> list[Adapter]:
    """Every version of every adapter of ``owner`` (of all tenants if None), oldest first."""
    query = select(Adapter).order_by(Adapter.id)
    if owner is not None:
        query = query.where(Adapter.owner_id == owner.id)
    return list(await session.scalars(query))


async def page_adapters(
    session: AsyncSession,
    page: PageRequest,
    owner: Tenant | None = None,
    *,
    name_prefix: str | None = None,
) -> Page[Adapter]:
    """One page of ``list_adapters`` (``name_prefix``: names starting so); an opaque cursor over
    the row id, walked on the primary key or the (owner_id, id) index."""
    query = select(Adapter).order_by(Adapter.id).limit(page.limit + 1)
    if owner is not None:
        query = query.where(Adapter.owner_id == owner.id)
    if name_prefix:
        query = query.where(Adapter.name.startswith(name_prefix, autoescape=True))
    if page.after is not None:
        (after_id,) = decode_cursor(page.after, (int,))
        query = query.where(Adapter.id > after_id)
    return make_page(list(await session.scalars(query)), page, lambda a: encode_cursor(a.id))


async def page_newest(
    session: AsyncSession, owner: Tenant, page: PageRequest, *, name_prefix: str | None = None
) -> Page[Adapter]:
    """One page of ``list_newest``: the newest version of each of ``owner``'s names, by name; the
    cursor is the last name shown. The names come from the (owner_id, name, version) index."""
    names = (
        select(func.max(Adapter.id))
        .where(Adapter.owner_id == owner.id)
        .group_by(Adapter.name)
        .order_by(Adapter.name)
        .limit(page.limit + 1)
    )
    if name_prefix:
        names = names.where(
            Adapter.name >= name_prefix, Adapter.name.startswith(name_prefix, autoescape=True)
        )
    if page.after is not None:
        names = names.where(Adapter.name > page.after)
    ids = list(await session.scalars(names))
    rows = list(await session.scalars(select(Adapter).where(Adapter.id.in_(ids)).order_by(Adapter.name)))
    return make_page(rows, page, lambda a: a.name)


async def page_versions(session: AsyncSession, owner: Tenant, name: str, page: PageRequest) -> Page[Adapter]:
    """One page of ``list_versions`` (newest first; an opaque cursor); ``NotFound`` if the adapter
    has no version at all."""
    query = (
        select(Adapter)
        .where(Adapter.owner_id == owner.id, Adapter.name == name)
        .order_by(Adapter.id.desc())
        .limit(page.limit + 1)
    )
    if page.after is not None:
        (after_id,) = decode_cursor(page.after, (int,))
        query = query.where(Adapter.id < after_id)
    rows = list(await session.scalars(query))
    if not rows and (page.after is None or not await _versions(session, owner.id, name)):
        raise NotFound("adapter", name)
    return make_page(rows, page, lambda a: encode_cursor(a.id))


async def list_newest(session: AsyncSession, owner: Tenant) -> list[Adapter]:
    """The newest version of each of ``owner``'s adapters, ordered by name."""
    newest: dict[str, Adapter] = {}
    for adapter in await list_adapters(session, owner):  # oldest first: newer ones win
        newest[adapter.name] = adapter
    return [newest[name] for name in sorted(newest)]


async def set_visibility(session: AsyncSession, owner: Tenant, name: str, visibility: Visibility) -> Adapter:
    """Make ``owner``'s adapter ``name`` (every version) private or public; returns the newest."""
    _check_visibility(visibility)
    newest = await get_adapter(session, owner, name)
    await _set_visibility(session, owner.id, name, visibility)
    return newest


async def delete_adapter(
    session: AsyncSession, owner: Tenant, name: str, version: str | None = None
) -> list[AdapterRef]:
    """Delete one version of ``owner``'s adapter ``name``, or every version (``version`` None).

    ``NotFound`` if nothing matches. Returns what was deleted: the caller unloads those
    versions and removes the files that ``is_path_referenced`` says nobody else uses.
    """
    versions = await _versions(session, owner.id, name)
    doomed = [v for v in versions if version is None or v.version == version]
    if not doomed:
        raise NotFound("adapter", name if version is None else f"{name}@{version[:12]}")
    refs = [AdapterRef.of(v) for v in doomed]
    await session.execute(delete(Adapter).where(Adapter.id.in_([v.id for v in doomed])))
    for v in doomed:
        session.expunge(v)
    return refs


async def adapter_usage(session: AsyncSession, owner: Tenant) -> AdapterUsage:
    """How many adapter names ``owner`` has and how many bytes their versions take."""
    num_names = await session.scalar(
        select(func.count(func.distinct(Adapter.name))).where(Adapter.owner_id == owner.id)
    )
    num_bytes = await session.scalar(
        select(func.coalesce(func.sum(Adapter.nbytes), 0)).where(Adapter.owner_id == owner.id)
    )
    return AdapterUsage(num_adapters=int(num_names or 0), num_bytes=int(num_bytes or 0))


async def is_path_referenced(session: AsyncSession, path: str) -> bool:
    """Whether any adapter version (of any tenant) still points at ``path`` in the store."""
    return bool(await session.scalar(select(exists().where(Adapter.path == path))))


def _may_use(caller: Tenant, adapter: Adapter) -> bool:
    if adapter.owner_id == caller.id:
        return True
    return adapter.visibility == "public" and not adapter.owner.disabled


async def _versions(session: AsyncSession, owner_id: int, name: str) -> list[Adapter]:
    query = (
        select(Adapter).where(Adapter.owner_id == owner_id, Adapter.name == name).order_by(Adapter.id.desc())
    )
    return list(await session.scalars(query))


async def _set_visibility(session: AsyncSession, owner_id: int, name: str, visibility: Visibility) -> None:
    await session.execute(
        update(Adapter)
        .where(Adapter.owner_id == owner_id, Adapter.name == name)
        .values(visibility=visibility)
        .execution_options(synchronize_session="fetch")
    )


async def _check_quotas(session: AsyncSession, owner: Tenant, *, is_new_name: bool, nbytes: int) -> None:
    if owner.max_adapters is None and owner.max_adapter_bytes is None:
        return
    usage = await adapter_usage(session, owner)
    if is_new_name and owner.max_adapters is not None and usage.num_adapters + 1 > owner.max_adapters:
        raise QuotaExceeded("max_adapters", owner.max_adapters, usage.num_adapters + 1)
    if owner.max_adapter_bytes is not None and usage.num_bytes + nbytes > owner.max_adapter_bytes:
        raise QuotaExceeded("max_adapter_bytes", owner.max_adapter_bytes, usage.num_bytes + nbytes)


def _check_visibility(visibility: str) -> None:
    if visibility not in VISIBILITIES:
        raise InvalidInput("visibility", f"must be one of {', '.join(VISIBILITIES)}")


def _check_new(new: NewAdapter) -> None:
    check_adapter_name(new.name)
    _check_visibility(new.visibility or "")
    if not _VERSION.fullmatch(new.version):
        raise InvalidInput("version", "must be a sha256 hex digest (64 lower-case hex digits)")
    if isinstance(new.rank, bool) or new.rank < 1:
        raise InvalidInput("rank", "must be a positive integer")
    if isinstance(new.nbytes, bool) or new.nbytes < 0:
        raise InvalidInput("nbytes", "must be a non-negative integer")
    if not new.base_model or not new.path:
        raise InvalidInput("base_model" if not new.base_model else "path", "must not be empty")
