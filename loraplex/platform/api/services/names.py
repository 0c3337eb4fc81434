"""What a tenant name and an adapter name may look like.

Neither may contain ``/``: ``owner/name`` is how a request names another tenant's public
adapter, so a slash inside either name would make that ambiguous. Tenant names are lower
case so that ``Acme`` and ``acme`` cannot be two tenants that look alike in a listing.
"""

from __future__ import annotations

import re

from loraplex.platform.api.services.errors import InvalidInput
from loraplex.storage.db.models import ADAPTER_NAME_MAX, TENANT_NAME_MAX

_TENANT_NAME = re.compile(rf"[a-z0-9][a-z0-9_-]{{0,{TENANT_NAME_MAX - 1}}}")
_ADAPTER_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{ADAPTER_NAME_MAX - 1}}}")


def check_tenant_name(name: str) -> str:
    """``name`` if it is a valid tenant name; ``InvalidInput`` otherwise."""
    if not _TENANT_NAME.fullmatch(name):
        raise InvalidInput(
            "name",
            f"a tenant name is 1-{TENANT_NAME_MAX} characters of a-z, 0-9, '_' and '-', "
            "starting with a letter or digit",
        )
    return name


def check_adapter_name(name: str) -> str:
    """``name`` if it is a valid adapter name; ``InvalidInput`` otherwise."""
    if not _ADAPTER_NAME.fullmatch(name):
        raise InvalidInput(
            "name",
            f"an adapter name is 1-{ADAPTER_NAME_MAX} characters of A-Z, a-z, 0-9, '.', '_' and '-', "
            "starting with a letter or digit",
        )
    return name
