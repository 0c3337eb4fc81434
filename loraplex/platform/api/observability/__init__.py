"""What the server tells its operator: metrics, readiness, access logs.

| module | owns |
|---|---|
| ``record`` | ``RequestRecord``: one request as the routes saw it (tenant, adapter, tokens, error) |
| ``error_handlers`` | the app's exception handlers: OpenAI's error body, the error noted on the record |
| ``observer`` | ``RequestObserver``: the middleware that opens and closes the records; 503 while draining |
| ``metrics`` | ``ServerMetrics``: the registry of ``GET /metrics`` (per request; snapshots when scraped) |
| ``vllm_metrics`` | ``VLLMCollector``: the engine's snapshot in vLLM's metric names, for routers |
| ``kv_events_metrics`` | ``KVEventsCollector``: the KV event publisher's counters (published, dropped) |
| ``metrics_listener`` | ``MetricsListener``: ``GET /metrics`` alone on ``metrics_port``, without auth |
| ``access_log`` | one JSON line per request on the ``loraplex.access`` logger |
| ``readiness`` | ``check_ready``: what ``GET /ready`` answers |
"""
