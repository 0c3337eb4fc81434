"""The HTTP layer: one OpenAI-compatible FastAPI app over ``AsyncEngine``, with tenants or without.

It reaches the engine only through ``AsyncEngine`` (an import-linter contract forbids the
engine's internals, the model and the KV storage here).

| module | owns |
|---|---|
| ``app`` | ``build_app``: the one app factory (single-tenant = a static gate and no database) |
| ``state`` | ``AppState``: the engine, the settings, the gate and the gateway every route shares |
| ``deps`` | every dependency the routes declare (``StateDep``, ``CallDep``, ``SessionDep``, ...) |
| ``errors`` | ``APIError``, OpenAI's error body and the one map of every exception to it (a leaf) |
| ``token_text`` | ``TokenText``: single tokens' text for logprobs, cached |
| ``middleware`` | the request body size limit (per path: uploads have their own) |
| ``connections`` | ``ConnectionGuard``: header, body and keep-alive timeouts, the connection cap |
| ``open_mode`` | open mode's guard: ``Host`` and ``Origin`` of the local machine only |
| ``gateway_stats`` | ``GatewayStats``: the gateway's counters at one moment (what ``/metrics`` reads) |
| ``gateway`` | ``Gateway``: database, quotas, adapter store and catalog; tenant deletion, cache reset |
| ``schemas`` | request and response bodies of the gateway's own APIs (admin, adapters) |
| ``background`` | work that must finish after a response (settling quotas, usage records) |
| ``usage_buffer`` | ``UsageBuffer``: usage records held through a database outage, written in batches |
| ``server`` | ``Server`` / ``serve``: uvicorn until a signal (drained first) or the engine dies (exit 1) |
| ``lifecycle`` | ``Lifecycle``: draining for a shutdown, the requests in flight |
| ``observability/`` | ``/metrics``, ``/ready``, access logs: a ``RequestRecord`` per request |
| ``openai/`` | the OpenAI surface: request bodies, params, the request pipeline, responses, SSE |
| ``tenancy/`` | the request gate, API keys and the admin token, quotas, usage accounting |
| ``catalog/`` | tenants' adapters: uploads, deletions, versions registered in the engine |
| ``services/`` | what the routes, the admin UI and the CLI do to the metadata database |
| ``routes/`` | one router per resource: completions, chat, models, health, metrics, adapters, admin |
"""
