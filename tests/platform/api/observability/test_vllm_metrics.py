"""The vLLM metric dialect, read the way a router reads it: ``/metrics`` parsed by prometheus_client.

The tiny engine (LoRA on, ``max_loras=2``) behind a real gateway (SQLite) with PEFT adapters
uploaded. Checked: every vLLM family a router reads is there with its type and exact labels;
an adapter with a request in flight is named in ``running_lora_adapters``; the residency
gauges follow loads and evictions (a third adapter evicts the least recently used one from the
device pages to the host LRU); with 2,000 adapters resident the series stay capped; the metrics
port answers ``/metrics`` without auth and nothing else.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from support.gateway import (
    ADAPTER_SPEC,
    ADMIN,
    BASE,
    Admin,
    bearer,
    completion_body,
    gateway_engine,
    make_gateway,
    peft_adapter_dir,
    serving,
    settings_for,
    upload,
    zip_bytes,
)
from support.ports import free_port

from loraplex import SamplingParams
from loraplex.adapters import LoRARequest
from loraplex.platform.api.observability.kv_events_metrics import KVEventsCollector
from loraplex.platform.api.observability.vllm_metrics import MAX_LOADED_ADAPTER_SERIES, VLLMCollector
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine

__all__ = ["gateway_engine", "peft_adapter_dir"]  # fixtures used by this module

PER_ENGINE = {"model_name", "engine"}
EXPECTED: dict[str, tuple[str, set[str]]] = {
    "vllm:num_requests_running": ("gauge", PER_ENGINE),
    "vllm:num_requests_waiting": ("gauge", PER_ENGINE),
    "vllm:kv_cache_usage_perc": ("gauge", PER_ENGINE),
    "vllm:gpu_cache_usage_perc": ("gauge", PER_ENGINE),
    "vllm:cache_config_info": (
        "gauge",
        {
            "block_size",
            "cache_dtype",
            "enable_prefix_caching",
            "gpu_memory_utilization",
            "num_cpu_blocks",
            "num_gpu_blocks",
            "engine",
        },
    ),
    "vllm:prefix_cache_queries": ("counter", PER_ENGINE),
    "vllm:prefix_cache_hits": ("counter", PER_ENGINE),
    "vllm:lora_requests_info": ("gauge", {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}),
    "vllm:lora_adapter_loaded": ("gauge", PER_ENGINE | {"adapter_name", "level", "pinned", "rank"}),
    "vllm:num_gpu_loaded_lora_adapters": ("gauge", PER_ENGINE),
    "vllm:num_cpu_loaded_lora_adapters": ("gauge", PER_ENGINE),
    "vllm:max_gpu_lora_adapters": ("gauge", PER_ENGINE),
    "vllm:lora_adapter_load_seconds": ("histogram", PER_ENGINE),
}


def parse(text: str) -> dict[str, tuple[str, list[Sample]]]:
    """family name -> (type, samples), as prometheus_client's parser reads the exposition."""
    return {f.name: (f.type, list(f.samples)) for f in text_string_to_metric_families(text)}


def loaded(families: dict[str, tuple[str, list[Sample]]]) -> dict[str, tuple[str, str]]:
    """adapter name -> (level, pinned) from ``vllm:lora_adapter_loaded``."""
    _, samples = families["vllm:lora_adapter_loaded"]
    assert all(s.value == 1.0 for s in samples)
    return {s.labels["adapter_name"]: (s.labels["level"], s.labels["pinned"]) for s in samples}


def single(families: dict[str, tuple[str, list[Sample]]], name: str) -> Sample:
    _, samples = families[name]
    assert len(samples) == 1, samples
    return samples[0]


@pytest.mark.slow
@pytest.mark.asyncio
async def test_vllm_families_types_labels_running_adapters_and_residency(
    gateway_engine: AsyncEngine, peft_adapter_dir: Path, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    from support.adapters import make_peft_adapter

    app = make_gateway(gateway_engine, settings_for(tmp_path, f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"))
    others = {}
    for name, seed in (("de", 11), ("es", 12)):
        make_peft_adapter(tiny_dirs["gqa_tied"], tmp_path / name, seed=seed, spec=ADAPTER_SPEC)
        others[name] = zip_bytes(tmp_path / name)
    async with serving(app) as client:
        admin = Admin(client)
        acme = await admin.tenant_with_key("acme")
        assert (await upload(client, acme, "fr", zip_bytes(peft_adapter_dir))).status_code == 201
        assert (await upload(client, acme, "pub", others["de"], visibility="public")).status_code == 201
        assert (await upload(client, acme, "es", others["es"])).status_code == 201

        families = parse((await client.get("/metrics", headers=ADMIN)).text)
        for name, (kind, labels) in EXPECTED.items():
            assert name in families, f"{name} missing"
            got_kind, samples = families[name]
            assert got_kind == kind, (name, got_kind)
            for sample in samples:
                assert set(sample.labels) - {"le"} == labels, (name, sample.labels)
        info = single(families, "vllm:cache_config_info")
        assert (
            info.value == 1 and info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "128"
        )
        assert single(families, "vllm:max_gpu_lora_adapters").value == 2  # max_loras
        assert single(families, "vllm:num_requests_running").labels["model_name"] == BASE

        # A request on "fr" in flight: a scrape while it runs names it.
        body = completion_body("fr", max_tokens=400)
        running = asyncio.create_task(client.post("/v1/completions", json=body, headers=bearer(acme)))
        while True:
            during = parse((await client.get("/metrics", headers=ADMIN)).text)
            if single(during, "vllm:num_requests_running").value > 0:
                break
            assert not running.done(), "the request ended before a scrape saw it run"
            await asyncio.sleep(0.01)
        assert (await running).status_code == 200
        lora_info = single(during, "vllm:lora_requests_info")
        assert lora_info.labels["running_lora_adapters"] == "fr", lora_info.labels
        assert lora_info.labels["max_lora"] == "2"
        assert abs(lora_info.value - time.time()) < 120  # a Unix time, as vLLM's (the newest wins)
        assert loaded(during)["fr"] == ("gpu", "true")  # pinned by the running request
        assert single(during, "vllm:num_gpu_loaded_lora_adapters").value == 1

        # Loads and evictions: pub then es take the two device slots; fr, least recently used,
        # is evicted to the host LRU. The load-time histogram counts every load.
        for model in ("acme/pub", "es"):
            r = await client.post("/v1/completions", json=completion_body(model), headers=bearer(acme))
            assert r.status_code == 200, r.text
        after = parse((await client.get("/metrics", headers=ADMIN)).text)
        assert loaded(after) == {"es": ("gpu", "false"), "acme/pub": ("gpu", "false"), "fr": ("cpu", "false")}
        assert single(after, "vllm:num_gpu_loaded_lora_adapters").value == 2
        assert single(after, "vllm:num_cpu_loaded_lora_adapters").value == 3  # the host LRU holds all three
        _, load_samples = after["vllm:lora_adapter_load_seconds"]
        count = next(s for s in load_samples if s.name.endswith("_count"))
        assert count.value == 3
        assert next(s for s in load_samples if s.labels.get("le") == "+Inf").value == 3
        idle = single(after, "vllm:lora_requests_info")
        assert idle.labels["running_lora_adapters"] == "" and idle.labels["waiting_lora_adapters"] == ""


@pytest.mark.slow
def test_residency_series_stay_capped_with_2000_adapters(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    from support.adapters import make_peft_adapter

    folder = tmp_path / "adapter"
    make_peft_adapter(
        tiny_dirs["gqa_tied"], folder, seed=3, spec=dict(r=1, lora_alpha=2, target_modules=["q_proj"])
    )
    config = EngineConfig(
        model=str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=64, enable_lora=True, max_lora_rank=8
    )
    engine = LLMEngine(config)
    # One set of files under 2,000 names: every one is registered and in the host LRU.
    for i in range(1, 2001):
        engine.add_lora(LoRARequest(f"tenant{i % 97}/adapter-{i}", i, str(folder)))
    engine.publish_stats()
    async_engine = AsyncEngine(engine)
    try:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(VLLMCollector(async_engine, BASE, 0.9, True))
        families = parse(generate_latest(registry).decode())
        assert single(families, "vllm:num_cpu_loaded_lora_adapters").value == 2000
        _, series = families["vllm:lora_adapter_loaded"]
        assert len(series) == MAX_LOADED_ADAPTER_SERIES < 2000
        total = sum(len(samples) for _, samples in families.values())
        assert total < MAX_LOADED_ADAPTER_SERIES + 60, total  # everything else is a handful
        # lora_requests_info is one series, however many adapters there are.
        assert len(families["vllm:lora_requests_info"][1]) == 1
    finally:
        async_engine.shutdown()


def test_kv_event_counters_are_exported_only_with_events_on(tiny_dirs: dict[str, Path]) -> None:
    port = free_port()
    events = f'{{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:{port}"}}'
    for kv_events_config in (None, events):
        config = EngineConfig(
            model=str(tiny_dirs["gqa_tied"]),
            dtype="float32",
            num_kv_blocks=16,
            kv_events_config=kv_events_config,
        )
        llm = LLMEngine(config)
        llm.add_request("a", list(range(5, 40)), SamplingParams(max_tokens=2))
        while llm.has_unfinished_requests():
            llm.step()
        deadline = time.monotonic() + 10
        llm.publish_stats()
        # The publisher thread sends after the step: wait until a snapshot shows it.
        while kv_events_config and not (llm.stats.kv_events and llm.stats.kv_events.num_batches_published):
            assert time.monotonic() < deadline, "no batch was published"
            time.sleep(0.05)
            llm.publish_stats()
        engine = AsyncEngine(llm)
        try:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(KVEventsCollector(engine))
            families = parse(generate_latest(registry).decode())
            if kv_events_config is None:
                assert families == {}
                continue
            outcomes = {s.labels["outcome"]: s.value for s in families["loraplex_kv_events_batches"][1]}
            assert outcomes["published"] >= 1 and outcomes["dropped"] == 0
            stored = {s.labels["outcome"]: s.value for s in families["loraplex_kv_events"][1]}
            assert stored["published"] >= outcomes["published"] and stored["dropped"] == 0
            assert single(families, "loraplex_kv_events_errors").value == 0
        finally:
            engine.shutdown()


@pytest.mark.asyncio
async def test_metrics_port_serves_metrics_without_auth_and_nothing_else(
    gateway_engine: AsyncEngine, tmp_path: Path
) -> None:
    port = free_port()
    settings = settings_for(
        tmp_path, f"sqlite+aiosqlite:///{tmp_path / 'g.db'}", metrics_port=port, metrics_require_admin=True
    )
    app = make_gateway(gateway_engine, settings)
    async with serving(app) as client:
        assert (await client.get("/metrics")).status_code == 401  # the serving port: the operator's
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as plain:
            r = await plain.get("/metrics")
            assert r.status_code == 200 and "vllm:num_requests_waiting" in r.text
            assert "loraplex_num_requests_waiting" in r.text
            for path in ("/v1/models", "/admin/api/tenants", "/health", "/"):
                assert (await plain.get(path)).status_code == 404, path
            assert (await plain.post("/metrics")).status_code in (404, 405)
    # Stopped with the app: the port is closed again.
    await asyncio.sleep(0.1)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as plain:
        with pytest.raises(httpx.ConnectError):
            await plain.get("/metrics")
