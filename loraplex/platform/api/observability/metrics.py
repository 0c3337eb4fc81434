"""``ServerMetrics``: the Prometheus registry behind ``GET /metrics``.

Two kinds of series, one registry per app (tests build many apps in one process):

- **Per request**, counted when the ``RequestObserver`` closes a request's record: the latency
  histograms, ``loraplex_requests_total{tenant,status}``, the token counters per tenant and
  ``loraplex_rejected_requests_total{reason}``. Tokens are counted the way the usage records
  count them (``tokens_used`` over the last output of each prompt), so the two agree.
- **Snapshots**, read at scrape time by ``SnapshotCollector`` from the engine's ``EngineStats``
  (one step's consistent picture, never blocking the engine) and ``Gateway.stats()``: queue
  gauges, KV blocks per tier, prefix-cache tokens, adapters, the KV tiers' counters.

``status`` is the HTTP status the client was told (a stream that failed after its 200 counts
under its error event's status; 499: the client left). ``tenant`` is the tenant's name
(``local`` in open and single-tenant mode, ``unknown`` before authentication); with
``metrics_tenant_label`` off the label is dropped (one series per status instead of one per
tenant and status: choose that with thousands of tenants). With it on, at most
``metrics_max_tenants`` tenants get series of their own (the first seen); the rest count under
``tenant="(other)"``, and a deleted tenant's series are removed (``forget_tenant``), which frees its
place, so the number of series stays bounded whatever tenants come and go.

One process serves one port (the engine lives in it), so prometheus-client's multiprocess
mode is not needed: a replica is scraped per pod.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplex.platform.api.errors import rejection_reason
from loraplex.platform.api.observability.record import RequestRecord
from loraplex.platform.api.tenancy.tenant_gate import tokens_used
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.errors import REJECTION_REASONS

if TYPE_CHECKING:
    from loraplex.platform.api.gateway_stats import GatewayStats

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets cover a GPU (milliseconds) and a loaded 2-core CPU (tens of seconds) alike.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


UNKNOWN_TENANT = "unknown"
OTHER_TENANTS = "(other)"
"""The label of tenants past ``metrics_max_tenants`` (no tenant name has parentheses)."""

_TIER_COUNTERS = (
    ("hits", "blocks this tier served (promotion or swap-in)"),
    ("misses", "blocks asked of this tier that it could not serve"),
    ("promotions", "blocks that left this tier for the accelerator"),
    ("demotions", "blocks this tier accepted from the tier above"),
    ("evictions", "blocks pushed out of this tier to make room"),
    ("drops", "blocks offered that this tier could not keep"),
    ("bytes_in", "block bytes written into this tier"),
    ("bytes_out", "block bytes read out of this tier"),
    ("io_errors", "OSErrors reading or writing this tier"),
    ("checksum_failures", "records whose payload checksum did not match"),
    ("invalid_records", "records with a bad header (truncated, zeroed, another model)"),
)


class SnapshotCollector(Collector):
    """The engine's and the gateway's state, read from their snapshots at each scrape."""

    def __init__(
        self, engine: AsyncEngine, gateway_stats: Callable[[], GatewayStats] | None, block_size: int
    ) -> None:
        self.engine = engine
        self.gateway_stats = gateway_stats
        self.block_size = block_size

    def collect(self) -> Iterator[Metric]:
        yield from self._engine_families()
        if self.gateway_stats is not None:
            yield from self._gateway_families(self.gateway_stats())

    def _engine_families(self) -> Iterator[Metric]:
        stats = self.engine.stats
        yield _gauge("loraplex_num_requests_running", "Sequences in the running batch.", stats.num_running)
        yield _gauge(
            "loraplex_num_requests_waiting",
            "Sequences waiting to be admitted (new, preempted, or waiting for blocks from a tier).",
            stats.num_waiting,
        )
        yield _gauge(
            "loraplex_num_requests_swapped", "Waiting sequences whose tail a tier holds.", stats.num_swapped
        )
        yield _counter("loraplex_engine_steps", "Engine steps run.", stats.step)
        yield _counter(
            "loraplex_num_preemptions", "Sequences preempted for lack of KV blocks.", stats.num_preemptions
        )
        yield _counter(
            "loraplex_batched_tokens",
            "Tokens run through the model (prefill and decode).",
            stats.num_batched_tokens,
        )
        kv = stats.kv
        used = GaugeMetricFamily("loraplex_kv_blocks_used", "KV blocks in use, per tier.", labels=["tier"])
        total = GaugeMetricFamily("loraplex_kv_blocks_total", "KV blocks each tier holds.", labels=["tier"])
        for tier, num_used, num_total in (
            ("device", kv.num_used_device_blocks, kv.num_device_blocks),
            ("host", kv.num_used_host_blocks, kv.num_host_blocks),
            ("disk", kv.num_used_disk_blocks, kv.num_disk_blocks),
        ):
            used.add_metric([tier], num_used)
            total.add_metric([tier], num_total)
        yield used
        yield total
        device = GaugeMetricFamily(
            "loraplex_device_pool_blocks",
            "The device pool's blocks by holder: KV of running sequences, adapter pages (borrowed "
            "from the pool's top), free (cached prefix blocks included).",
            labels=["holder"],
        )
        free = kv.num_device_blocks - kv.num_used_device_blocks - kv.num_adapter_device_blocks
        for holder, count in (("kv", kv.num_used_device_blocks), ("adapters", kv.num_adapter_device_blocks)):
            device.add_metric([holder], count)
        device.add_metric(["free"], free)
        yield device
        yield _counter(
            "loraplex_kv_window_freed_blocks",
            "KV blocks returned to the pool while their sequence ran, having left every layer's "
            "sliding window (0 unless every layer has a window).",
            kv.num_window_freed_blocks,
        )
        prefix = stats.prefix_cache
        yield _counter(
            "loraplex_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (at admission).",
            prefix.num_query_tokens,
        )
        hits = CounterMetricFamily(
            "loraplex_prefix_cache_hits",
            "Prompt tokens served from the cache: device = every cached token at admission (including "
            "those a lower tier brought up); host / disk = tokens of the blocks that tier served.",
            labels=["tier"],
        )
        hits.add_metric(["device"], prefix.num_hit_tokens)
        for metrics in stats.tiers:
            hits.add_metric([metrics.tier], metrics.hits * self.block_size)
        yield hits
        for name, help_text in _TIER_COUNTERS:
            family = CounterMetricFamily(
                f"loraplex_kv_tier_{name}", f"KV tiers: {help_text}.", labels=["tier"]
            )
            for metrics in stats.tiers:
                family.add_metric([metrics.tier], getattr(metrics, name))
            yield family
        adapters = stats.adapters
        resident = GaugeMetricFamily(
            "loraplex_adapters_resident",
            "Adapters resident in the device page pool / cached in host memory.",
            labels=["tier"],
        )
        resident.add_metric(["device"], 0 if adapters is None else adapters.num_on_device)
        resident.add_metric(["host"], 0 if adapters is None else adapters.num_in_host)
        yield resident
        yield _gauge(
            "loraplex_adapters_registered",
            "Adapters registered.",
            0 if adapters is None else adapters.num_registered,
        )
        yield _counter(
            "loraplex_adapter_loads",
            "Adapters written into device pages.",
            0 if adapters is None else adapters.num_slot_loads,
        )
        yield _counter(
            "loraplex_adapter_disk_reads",
            "Adapters read from the store into host memory (host-cache misses).",
            0 if adapters is None else adapters.num_disk_reads,
        )
        yield _counter(
            "loraplex_adapter_evictions",
            "Resident adapters evicted from the device page pool to make room.",
            0 if adapters is None else adapters.num_evictions,
        )
        pool = GaugeMetricFamily(
            "loraplex_adapter_pool_bytes",
            "Adapter page pool: bytes of pages in use, bytes of device-pool blocks it holds (used "
            "and free pages), and its cap (lora_memory).",
            labels=["kind"],
        )
        pool.add_metric(["used"], 0 if adapters is None else adapters.pool_used_bytes)
        pool.add_metric(["allocated"], 0 if adapters is None else adapters.pool_bytes)
        pool.add_metric(["budget"], 0 if adapters is None else adapters.pool_budget_bytes)
        yield pool
        pages_family = GaugeMetricFamily(
            "loraplex_adapter_pages_used",
            "Adapter pages in use per projection group (each page: lora_page_rank rank rows).",
            labels=["group"],
        )
        for group, num_pages in ({} if adapters is None else adapters.pages_used).items():
            pages_family.add_metric([group], num_pages)
        yield pages_family

    def _gateway_families(self, stats: GatewayStats) -> Iterator[Metric]:
        yield _counter(
            "loraplex_usage_write_failures",
            "Usage records that could not be written.",
            stats.num_usage_write_failures,
        )
        yield _gauge(
            "loraplex_background_tasks_pending",
            "Usage writes and quota settlements in flight.",
            stats.num_background_pending,
        )
        yield _counter(
            "loraplex_background_tasks_failed", "Background tasks that failed.", stats.num_background_failed
        )
        up = GaugeMetricFamily(
            "loraplex_quota_backend_up",
            "1 while quotas can be checked (Redis reachable, or in process).",
            labels=["backend"],
        )
        up.add_metric([stats.quota_backend], 0 if stats.quota_backend_down else 1)
        yield up
        yield _counter(
            "loraplex_quota_backend_failures",
            "Failed calls to Redis for quotas.",
            stats.num_quota_backend_failures,
        )
        yield _counter(
            "loraplex_quota_backend_outages",
            "Times Redis for quotas went down.",
            stats.num_quota_backend_outages,
        )
        yield from _database_families(stats)


def _database_families(stats: GatewayStats) -> Iterator[Metric]:
    """The metadata database's outages and what kept serving through them (docs/operations.md)."""
    up = 0 if stats.database_down else 1
    yield _gauge("loraplex_database_up", "1 while the metadata database answers.", up)
    yield _counter(
        "loraplex_database_errors",
        "Calls that failed, or were answered 503 at once, because the database was unreachable.",
        stats.num_database_errors,
    )
    yield _counter(
        "loraplex_database_outages", "Times the database became unreachable.", stats.num_database_outages
    )
    hits = CounterMetricFamily(
        "loraplex_auth_cache_hits",
        "Authentications served from the key cache: fresh (within the TTL) or outage (database down).",
        labels=["kind"],
    )
    hits.add_metric(["fresh"], stats.num_auth_cache_hits)
    hits.add_metric(["outage"], stats.num_auth_cache_outage_hits)
    yield hits
    yield _gauge(
        "loraplex_usage_buffer_records", "Usage records waiting for the database.", stats.num_usage_pending
    )
    yield _counter(
        "loraplex_usage_records_dropped",
        "Usage records lost: the buffer was full, or shutdown could not write them.",
        stats.num_usage_dropped,
    )
    yield _counter(
        "loraplex_quota_refusals",
        "Requests and uploads refused by a quota (no usage row is written for them).",
        stats.num_quota_refusals,
    )


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_text, value=value)


class ServerMetrics:
    """One app's metrics: ``observe`` each closed request, ``render`` for a scrape."""

    def __init__(
        self,
        engine: AsyncEngine,
        gateway_stats: Callable[[], GatewayStats] | None,
        block_size: int,
        tenant_label: bool = True,
        max_tenants: int = 200,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.tenant_label = tenant_label
        self.max_tenants = max_tenants
        self._statuses: dict[str, set[str]] = {}
        """The tenants with series of their own, and the statuses each has a request series for."""
        by_tenant = ["tenant"] if tenant_label else []
        r = self.registry
        self.ttft = Histogram(
            "loraplex_time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "loraplex_inter_token_latency_seconds",
            "Time between successive tokens of one completion, per token.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "loraplex_e2e_request_latency_seconds",
            "From a request's arrival to the end of its response (requests that reached the engine).",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "loraplex_requests",
            "Completion requests answered, by the status the client was told.",
            [*by_tenant, "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "loraplex_prompt_tokens", "Prompt tokens of the requests that ran.", by_tenant, registry=r
        )
        self.cached_tokens = Counter(
            "loraplex_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache.",
            by_tenant,
            registry=r,
        )
        self.generation_tokens = Counter(
            "loraplex_generation_tokens", "Tokens generated (every completion of n).", by_tenant, registry=r
        )
        self.rejected = Counter(
            "loraplex_rejected_requests",
            "Completion requests refused or cut short, by reason.",
            ["reason"],
            registry=r,
        )
        for reason in REJECTION_REASONS:  # present from the start (zero): rate() works at once
            self.rejected.labels(reason=reason)
        r.register(SnapshotCollector(engine, gateway_stats, block_size))

    def observe(self, record: RequestRecord) -> None:
        """Count one closed request (completions and chat completions only)."""
        if not record.is_inference:
            return
        status = str(record.effective_status)
        tenant = {"tenant": self._label(record.tenant or UNKNOWN_TENANT, status)} if self.tenant_label else {}
        self.requests.labels(**tenant, status=status).inc()
        reason = None
        if record.error is not None:
            reason = rejection_reason(record.error)
        elif record.status in (400, 413):  # answered by a middleware, before any handler (413)
            reason = "invalid"
        if reason is not None:
            self.rejected.labels(reason=reason).inc()
        if not record.streams:
            return
        prompt, cached, generated = tokens_used([s.last for s in record.streams])
        for counter, value in (
            (self.prompt_tokens, prompt),
            (self.cached_tokens, cached),
            (self.generation_tokens, generated),
        ):
            (counter.labels(**tenant) if tenant else counter).inc(value)
        ttft = record.ttft_s
        if ttft is not None:
            self.ttft.observe(ttft)
        for stream in record.streams:
            for gap_s, num_tokens in stream.token_gaps_s:
                for _ in range(num_tokens):
                    self.itl.observe(gap_s)
        self.e2e.observe(record.latency_s)

    def _label(self, tenant: str, status: str) -> str:
        """``tenant``'s label: its name while it has (or gets) one of the ``max_tenants`` places."""
        statuses = self._statuses.get(tenant)
        if statuses is None:
            if tenant != UNKNOWN_TENANT and len(self._statuses) >= self.max_tenants:
                return OTHER_TENANTS
            statuses = self._statuses[tenant] = set()
        statuses.add(status)
        return tenant

    def forget_tenant(self, name: str) -> None:
        """Remove a deleted tenant's series (what it counted before stays in Prometheus' history)."""
        statuses = self._statuses.pop(name, None)
        if statuses is None:
            return
        for status in statuses:
            self.requests.remove(name, status)
        for counter in (self.prompt_tokens, self.cached_tokens, self.generation_tokens):
            with contextlib.suppress(KeyError):  # none of its requests ran: no token series
                counter.remove(name)

    def render(self) -> bytes:
        """The Prometheus text exposition of every series (call on the event loop)."""
        return generate_latest(self.registry)
