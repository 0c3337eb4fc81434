"""Adapters of tenants: uploads, deletions, and which versions this process has in the engine.

| module | owns |
|---|---|
| ``catalog`` | ``AdapterCatalog``: store files, database rows and the engine kept in step |
| ``upload_form`` | streaming a multipart upload to a staging folder, every part checked, with deadlines |
| ``engine_adapters`` | ``EngineAdapters``: versions registered in the engine (through ``AsyncEngine``) |
| ``runtime_loras`` | ``RuntimeLoRAs``: vLLM's runtime load / unload, into the operator's tenant |
"""
