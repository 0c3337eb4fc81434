"""Errors the services raise; the gateway maps each class to one HTTP status, the CLI to a message.

| error | meaning | gateway answer |
|---|---|---|
| ``NotFound`` | no such tenant, key or adapter, *or* one the caller may not see | 404 |
| ``Conflict`` | the name (or adapter version) is taken | 409 |
| ``QuotaExceeded`` | the tenant's ``max_adapters`` / ``max_adapter_bytes`` would be exceeded | 403 or 413 |
| ``InvalidInput`` | a name, quota or date the services refuse; ``field`` names it | 400 |
| ``EngineBusy`` | the engine must be idle for this (a prefix-cache reset); retry | 409 |

Messages name the kind and the name the caller gave, never a key, hash or prompt.
"""

from __future__ import annotations

from typing import Literal

ResourceKind = Literal["tenant", "key", "adapter"]
QuotaName = Literal["max_adapters", "max_adapter_bytes"]


class ServiceError(Exception):
    """Base class of the services' errors."""


class NotFound(ServiceError):
    """The resource does not exist, or the caller may not know that it does (same message)."""

    def __init__(self, kind: ResourceKind, name: str) -> None:
        super().__init__(f"{kind} {name!r} not found")
        self.kind: ResourceKind = kind
        self.name = name


class Conflict(ServiceError):
    """The resource already exists."""

    def __init__(self, kind: ResourceKind, name: str, detail: str = "already exists") -> None:
        super().__init__(f"{kind} {name!r} {detail}")
        self.kind: ResourceKind = kind
        self.name = name


class QuotaExceeded(ServiceError):
    """Storing this would take the tenant over one of its adapter quotas."""

    def __init__(self, quota: QuotaName, limit: int, requested: int) -> None:
        super().__init__(f"{quota} is {limit}; this would make it {requested}")
        self.quota: QuotaName = quota
        self.limit = limit
        self.requested = requested


class InvalidInput(ServiceError):
    """A value the services refuse; ``field`` is the argument (or body field) at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


class EngineBusy(ServiceError):
    """The engine must be idle for this and is not; ``retry_after_s`` is a hint."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
