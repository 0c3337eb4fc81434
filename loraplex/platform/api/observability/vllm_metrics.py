"""``VLLMCollector``: the engine's snapshot in vLLM's metric dialect, for inference routers.

Routers (llm-d's endpoint picker, the Gateway API Inference Extension, production-stack, AIBrix,
KServe) read vLLM's names, so ``/metrics`` carries them beside the ``loraplex_*`` families, read
from the same ``EngineStats`` snapshot at scrape time. Names, types and labels as vLLM's
``vllm/v1/metrics/loggers.py`` (and, for residency, vLLM's loaded-adapter gauges of
vllm#54830, which llm-d's ``lora-load-state-scorer`` reads):

| family | type | labels (``PE``: model_name, engine) | value |
|---|---|---|---|
| ``vllm:num_requests_running`` / ``_waiting`` | gauge | PE | sequences running / waiting |
| ``vllm:kv_cache_usage_perc``, ``vllm:gpu_cache_usage_perc`` | gauge | PE | KV blocks in use (0-1) |
| ``vllm:cache_config_info`` | gauge | ``CACHE_CONFIG_LABELS`` (block_size, num_gpu_blocks, ...) | 1 |
| ``vllm:prefix_cache_queries`` / ``_hits`` | counter | PE | prompt tokens looked up / found |
| ``vllm:lora_requests_info`` | gauge | max_lora, running_ / waiting_lora_adapters | snapshot time |
| ``vllm:lora_adapter_loaded`` | gauge | PE, adapter_name, level, pinned, rank | 1 per adapter |
| ``vllm:num_gpu_loaded_lora_adapters``, ``num_cpu_`` | gauge | PE | adapters in device / host |
| ``vllm:max_gpu_lora_adapters`` | gauge | PE | ``max_loras``, else ``max_num_seqs`` |
| ``vllm:lora_adapter_load_seconds`` | histogram | PE | device load durations |

The LoRA families exist only with ``enable_lora`` (as in vLLM), from start-up on. Adapter names
are what clients send in ``model``: a tenant's private adapter by its name, a public one as
``owner/name``. ``level="gpu"`` is the device page pool, also on a CPU-only engine. Unlike
vLLM's ``lora_requests_info``, which lists adapters with requests in flight only, the residency
gauges list every resident adapter, busy or idle.

Label sets stay bounded with thousands of adapters: the families are built anew at each scrape
from the snapshot, so an adapter that left memory has no series any more (nothing accumulates,
unlike a labelled ``Gauge`` that keeps every label set it was ever given), and
``vllm:lora_adapter_loaded`` lists at most ``MAX_LOADED_ADAPTER_SERIES`` adapters: those in device
pages first (bounded by ``lora_memory`` and ``max_loras``), then host-only ones, most recently
used first. The counts are exact whatever the cap. ``lora_requests_info`` is one series.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.stats import EngineStats

MAX_LOADED_ADAPTER_SERIES = 512
"""Most ``vllm:lora_adapter_loaded`` series in one scrape (device-resident adapters first)."""
ENGINE_INDEX = "0"
"""vLLM's ``engine`` label: one engine per replica here."""

# The families and the labels they carry: what tests and the Helm chart's picker configuration
# are checked against.
PER_ENGINE = ("model_name", "engine")
CACHE_CONFIG_LABELS = (
    "block_size",
    "cache_dtype",
    "enable_prefix_caching",
    "gpu_memory_utilization",
    "num_cpu_blocks",
    "num_gpu_blocks",
    "engine",
)
LORA_INFO_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")
LOADED_LABELS = (*PER_ENGINE, "adapter_name", "level", "pinned", "rank")


class VLLMCollector(Collector):
    """vLLM's families, built from the engine's last snapshot at each scrape."""

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        gpu_memory_utilization: float,
        enable_prefix_caching: bool,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enable_prefix_caching = enable_prefix_caching

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        yield from self._scheduler(stats)
        yield from self._cache(stats)
        if stats.adapters is not None:
            yield from self._lora(stats)
        if stats.spec_decode is not None:
            yield from self._spec_decode(stats)

    def _spec_decode(self, stats: EngineStats) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters (``speculative_config``)."""
        spec = stats.spec_decode
        assert spec is not None
        for name, doc, value in (
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens),
        ):
            yield self._per_engine(name, doc, value, CounterMetricFamily)
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*PER_ENGINE, "position"],
        )
        for pos, count in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([self.model_name, ENGINE_INDEX, str(pos)], count)
        yield per_pos

    def _per_engine(self, name: str, doc: str, value: float, kind: type = GaugeMetricFamily) -> Metric:
        family = kind(name, doc, labels=PER_ENGINE)
        family.add_metric([self.model_name, ENGINE_INDEX], value)
        return family

    def _scheduler(self, stats: EngineStats) -> Iterator[Metric]:
        yield self._per_engine(
            "vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running
        )
        yield self._per_engine(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting
        )

    def _cache(self, stats: EngineStats) -> Iterator[Metric]:
        kv = stats.kv
        usage = kv.num_used_device_blocks / kv.num_device_blocks if kv.num_device_blocks else 0.0
        yield self._per_engine(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage
        )
        yield self._per_engine(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage. "
            "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
            usage,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=CACHE_CONFIG_LABELS
        )
        limits = self.engine.limits
        info.add_metric(
            [
                str(limits.block_size),
                "auto",
                str(self.enable_prefix_caching),
                str(self.gpu_memory_utilization),
                str(kv.num_host_blocks),
                str(kv.num_device_blocks),
                ENGINE_INDEX,
            ],
            1.0,
        )
        yield info
        prefix = stats.prefix_cache
        yield self._per_engine(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            prefix.num_query_tokens,
            CounterMetricFamily,
        )
        yield self._per_engine(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            prefix.num_hit_tokens,
            CounterMetricFamily,
        )

    def _lora(self, stats: EngineStats) -> Iterator[Metric]:
        adapters = stats.adapters
        assert adapters is not None
        max_loras = adapters.max_loras if adapters.max_loras is not None else self.engine.limits.max_num_seqs
        info = GaugeMetricFamily(
            "vllm:lora_requests_info", "Running stats on lora requests.", labels=LORA_INFO_LABELS
        )
        info.add_metric(
            [str(max_loras), ",".join(stats.running_adapters), ",".join(stats.waiting_adapters)],
            stats.timestamp,
        )
        yield info
        loaded = GaugeMetricFamily(
            "vllm:lora_adapter_loaded",
            "LoRA adapters resident on this replica: level gpu (device page pool) or cpu (host memory).",
            labels=LOADED_LABELS,
        )
        for adapter in adapters.resident[:MAX_LOADED_ADAPTER_SERIES]:
            loaded.add_metric(
                [
                    self.model_name,
                    ENGINE_INDEX,
                    adapter.name,
                    adapter.level,
                    "true" if adapter.pinned else "false",
                    str(adapter.rank),
                ],
                1.0,
            )
        yield loaded
        yield self._per_engine(
            "vllm:num_gpu_loaded_lora_adapters",
            "LoRA adapters in the device page pool.",
            adapters.num_on_device,
        )
        yield self._per_engine(
            "vllm:num_cpu_loaded_lora_adapters", "LoRA adapters in host memory.", adapters.num_in_host
        )
        yield self._per_engine(
            "vllm:max_gpu_lora_adapters",
            "Most LoRA adapters one step serves (max_loras; without it max_num_seqs, memory permitting).",
            max_loras,
        )
        times = adapters.load_times
        histogram = HistogramMetricFamily(
            "vllm:lora_adapter_load_seconds",
            "Time to make a LoRA adapter resident in the device page pool (store read included on a miss).",
            labels=PER_ENGINE,
        )
        histogram.add_metric([self.model_name, ENGINE_INDEX], times.cumulative(), times.sum_s)
        yield histogram
