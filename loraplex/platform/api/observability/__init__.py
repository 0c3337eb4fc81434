"""What the server tells its operator: metrics, readiness, access logs.

record       RequestRecord: one HTTP request as the routes saw it (tenant, adapter, tokens,
             timings, error)
observer     RequestObserver: the ASGI middleware that opens a record per request, refuses new
             work while the server drains, and hands the closed record to the metrics and the
             access log
metrics      ServerMetrics: the Prometheus registry of GET /metrics (request histograms and
             counters; the engine's and the gateway's snapshots, read at scrape time)
access_log   one JSON line per request on the loraplex.access logger
readiness    check_ready: what GET /ready answers (draining, engine, database, migrations, quotas)
"""
