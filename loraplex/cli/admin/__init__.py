"""Operators' commands on the gateway's database and adapter store: tenants, API keys, adapters.

Every group reads the server's settings (``LORAPLEX_*``, the config file) and takes the ones it
needs as options before the subcommand (``loraplex tenants --database-url ... list``), with the
same names as ``loraplex serve``, so both work on the same database and adapter store. The
database is migrated to the newest schema first. Each group's module starts with its synopsis.

| module | owns |
|---|---|
| ``common`` | the settings options, the migrated database, telling replicas, printing pages |
| ``tenants`` | ``loraplex tenants create|update|list|disable``: tenants, quotas, fair-share weights |
| ``keys`` | ``loraplex keys create|list|revoke``: API keys |
| ``adapters`` | ``loraplex adapters upload|list|delete``: adapters, validated against the base model |
| ``db`` | ``loraplex db upgrade``: migrate the database and exit (a deployment's hook) |

``loraplex.cli.app`` adds each module's group (``tenants_app``, ``keys_app``, ...) to the root app.
"""
