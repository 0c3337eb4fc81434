"""The registry: adapters by id, and removed adapters whose device slot still drains.

Not thread-safe on its own; ``AdapterManager`` calls it under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from loraplex.adapters.errors import AdapterExistsError, AdapterNotFoundError, AdapterRemovedError
from loraplex.adapters.identity import AdapterIdentity
from loraplex.adapters.spec import ModuleName

Tier = Literal["device", "host", "disk"]


@dataclass(frozen=True)
class AdapterEntry:
    """What the manager remembers about a registered adapter."""

    identity: AdapterIdentity
    source: str  # the path it was added from
    folder: Path  # its disk-tier folder
    owned: bool  # True when the folder belongs to the store
    rank: int  # largest module rank
    target_modules: tuple[ModuleName, ...]
    host_nbytes: int  # size of its weights in the serving dtype


@dataclass(frozen=True)
class AdapterInfo:
    """A registered adapter as seen from outside: identity, shape, and where it is now."""

    identity: AdapterIdentity
    source: str
    folder: Path
    rank: int
    target_modules: tuple[ModuleName, ...]
    host_nbytes: int
    tier: Tier  # fastest tier holding it
    slot_idx: int | None
    num_pins: int  # running requests using its slot

    @property
    def adapter_id(self) -> int:
        return self.identity.adapter_id

    @property
    def name(self) -> str:
        return self.identity.name

    @property
    def owner(self) -> str | None:
        return self.identity.owner

    @property
    def version(self) -> str:
        return self.identity.version


class AdapterRegistry:
    """Live adapters by id (names unique per owner) and draining slots of removed ones."""

    def __init__(self) -> None:
        self._live: dict[int, AdapterEntry] = {}
        self._draining: dict[int, AdapterEntry] = {}  # slot_idx -> removed adapter still in use

    def get(self, adapter_id: int) -> AdapterEntry | None:
        return self._live.get(adapter_id)

    def require(self, adapter_id: int) -> AdapterEntry:
        """The live entry, or ``AdapterRemovedError`` (still draining) / ``AdapterNotFoundError``."""
        entry = self._live.get(adapter_id)
        if entry is not None:
            return entry
        for removed in self._draining.values():
            if removed.identity.adapter_id == adapter_id:
                raise AdapterRemovedError(
                    f"adapter {adapter_id} ({removed.identity.name!r}) was removed; "
                    "requests already running on it finish, new requests are refused"
                )
        raise AdapterNotFoundError(f"no adapter with id {adapter_id}")

    def find(self, name: str, owner: str | None) -> AdapterEntry | None:
        for entry in self._live.values():
            if entry.identity.name == name and entry.identity.owner == owner:
                return entry
        return None

    def existing(self, identity: AdapterIdentity) -> AdapterEntry | None:
        """The entry equal to ``identity`` if already registered; raise if id or name is taken otherwise."""
        entry = self._live.get(identity.adapter_id)
        if entry is not None and entry.identity == identity:
            return entry
        if entry is not None:
            raise AdapterExistsError(
                f"adapter id {identity.adapter_id} is already registered as {entry.identity.name!r} "
                f"(version {entry.identity.version[:12]}); remove it first"
            )
        clash = self.find(identity.name, identity.owner)
        if clash is not None:
            raise AdapterExistsError(
                f"owner {identity.owner!r} already has an adapter named {identity.name!r} "
                f"(id {clash.identity.adapter_id})"
            )
        return None

    def add(self, entry: AdapterEntry) -> None:
        assert entry.identity.adapter_id not in self._live, f"adapter {entry.identity.adapter_id} exists"
        self._live[entry.identity.adapter_id] = entry

    def remove(self, adapter_id: int) -> AdapterEntry:
        entry = self._live.pop(adapter_id, None)
        if entry is None:
            raise AdapterNotFoundError(f"no adapter with id {adapter_id}")
        return entry

    def entries(self) -> list[AdapterEntry]:
        """Live entries by id."""
        return [self._live[i] for i in sorted(self._live)]

    def live_versions(self) -> set[str]:
        return {e.identity.version for e in self._live.values()}

    def start_draining(self, slot_idx: int, entry: AdapterEntry) -> None:
        self._draining[slot_idx] = entry

    def finish_draining(self, slot_idx: int) -> AdapterEntry:
        return self._draining.pop(slot_idx)

    def draining(self) -> dict[int, AdapterEntry]:
        """Removed adapters still in use, by slot."""
        return dict(self._draining)
