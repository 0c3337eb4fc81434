"""Tenancy: who is calling, what they may name, whether their quotas admit the request, what it cost.

| module | owns |
|---|---|
| ``gate`` | the ``RequestGate`` contract (open, resolve, admit, close); the single-tenant ``StaticGate`` |
| ``tenant_gate`` | ``TenantGate``: API keys, per-tenant models, quota admission, usage records |
| ``auth`` | bearer credentials: a tenant's API key, the admin token |
| ``latencies`` | ``RecentLatencies``: time to first token of recent requests (dashboard p50 / p99) |
| ``auth_cache`` | ``Authenticator``: API key checks cached for a TTL, served through a database outage |
| ``quotas/`` | the limiter contract, Redis (Lua) and in-process implementations; a refusal's 429 / 503 |
| ``upload_admission`` | who may upload now: uploads in flight per tenant, rpm and concurrency |
| ``replica_events`` | Redis pub/sub between replicas: a tenant deleted on one has its KV purged on all |
"""
