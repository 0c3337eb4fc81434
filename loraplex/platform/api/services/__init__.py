"""Services: what the gateway's routes, the admin UI and the CLI do to the metadata database.

Each takes an ``AsyncSession`` and plain typed arguments, and returns ORM rows
(``loraplex.storage.db.models``) or small frozen dataclasses. They flush but never commit:
the caller owns the transaction (``Database.transaction()``; ``write=True`` for the calls
marked *reads, then writes*, see ``loraplex.storage.db.session``). They raise the typed errors
of ``errors`` and know nothing of HTTP. No key and no prompt text is ever logged.

| module | owns |
|---|---|
| ``tenants`` | tenants and their quotas (``TenantQuotas``): create, get, list, update, disable, delete |

Every ``list_*`` has a ``page_*`` twin that reads one page from a cursor (``pages``): the APIs,
the admin UI and the CLI list with those; the ``list_*`` read everything (small data, tests).
| ``keys`` | ``create_key`` (the key, once), ``authenticate``, ``list_keys``, ``revoke_key`` |
| ``adapters`` | the registry's rows: register, resolve, list, delete; per-tenant ACL and quotas |
| ``usage`` | ``record_usage``, ``query_usage``, ``usage_totals`` |
| ``names`` | what tenant and adapter names may look like |
| ``pages`` | keyset pagination: ``PageRequest`` (limit, after), ``Page`` (rows, cursors, has_more) |
| ``errors`` | ``NotFound``, ``Conflict``, ``QuotaExceeded``, ``InvalidInput`` |

Reads, then writes (open with ``write=True`` on SQLite): ``create_tenant``, ``ensure_tenant``,
``update_quotas``, ``set_disabled``, ``delete_tenant``, ``revoke_key``, ``register_adapter``,
``set_visibility``, ``delete_adapter``. ``authenticate`` reads, then writes only
``last_used_at``, and copes with losing that write; ``record_usage`` and ``create_key`` only write.
"""
