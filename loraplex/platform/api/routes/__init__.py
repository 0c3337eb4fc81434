"""The routers, one module per resource.

| module | serves |
|---|---|
| ``completions`` | ``POST /v1/completions`` |
| ``chat`` | ``POST /v1/chat/completions`` |
| ``models`` | ``GET /v1/models``, ``GET /v1/models/{id}`` |
| ``health`` | ``GET /health`` (liveness), ``GET /ready`` (readiness) |
| ``metrics`` | ``GET /metrics`` (Prometheus) |
| ``adapters`` | ``/v1/adapters``: a tenant's own adapters (with tenants only) |
| ``lora_adapters`` | vLLM's ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter`` (admin token) |
| ``admin`` | ``/admin/api``: tenants, keys, adapters, usage, the prefix cache (admin token, once) |
"""
