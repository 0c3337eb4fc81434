"""The chart's router option: an InferencePool over the replicas and llm-d's endpoint picker, rendered
with ``helm template`` (validated offline by test_chart.py, the InferencePool against its CRD's
schema), wired to the server's metrics port and KV events, and configured with metric names the
server really exports (cross-checked against a real ``/metrics`` exposition).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.charts import VALUE_SETS, Manifest, RenderError, of_kind, render, workload
from support.crd_schemas import INFERENCE_POOL

from loraplex.platform.api.observability.vllm_metrics import VLLMCollector
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.kv_events.config import KVEventsConfig

PICKER = "rel-loraplex-epp"


@pytest.fixture(scope="module")
def routed() -> list[Manifest]:
    return render(VALUE_SETS["router"])


def named(manifests: list[Manifest], kind: str, name: str) -> Manifest:
    (found,) = [m for m in of_kind(manifests, kind) if m["metadata"]["name"] == name]
    return found


def picker_config(manifests: list[Manifest]) -> dict[str, Any]:
    data = named(manifests, "ConfigMap", PICKER)["data"]["endpoint-picker.yaml"]
    config = yaml.safe_load(data)
    assert config["kind"] == "EndpointPickerConfig" and config["apiVersion"] == "llm-d.ai/v1alpha1"
    return dict(config)


def test_the_pool_selects_the_servers_and_names_the_picker(routed: list[Manifest]) -> None:
    (pool,) = of_kind(routed, "InferencePool")
    server = workload(routed)
    assert pool["spec"]["selector"]["matchLabels"] == server["spec"]["selector"]["matchLabels"]
    pod_labels = server["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    service = named(routed, "Service", PICKER)
    ref = pool["spec"]["endpointPickerRef"]
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert ref["name"] == PICKER and ref["port"]["number"] == grpc["port"] == 9002
    # What routers read on the pods.
    assert pod_labels["llm-d.ai/engine-type"] == "vllm"
    # Nothing else in the release carries the pool's labels: the picker is not a model server.
    picker_pods = named(routed, "Deployment", PICKER)["spec"]["template"]["metadata"]["labels"]
    assert not pool["spec"]["selector"]["matchLabels"].items() <= picker_pods.items()


def test_the_picker_scrapes_the_metrics_port_and_subscribes_to_kv_events(routed: list[Manifest]) -> None:
    args = named(routed, "Deployment", PICKER)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--model-server-metrics-port=9090" in args and "--pool-name=rel-loraplex" in args
    assert "--pool-group=inference.networking.k8s.io" in args
    (container,) = workload(routed)["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "metrics": 9090, "kv-events": 5557, "kv-replay": 5558}
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert list(env).index("POD_IP") < list(env).index("LORAPLEX_KV_EVENTS_CONFIG")  # expanded in order
    # The server's own parser reads what the chart wrote.
    events = KVEventsConfig.parse(env["LORAPLEX_KV_EVENTS_CONFIG"]["value"])
    assert events.publishes and events.endpoint == "tcp://*:5557" and events.replay_endpoint == "tcp://*:5558"
    assert events.topic == "kv@$(POD_IP):8000@llama-3.2-1b" and events.encoding == "array"
    config = picker_config(routed)
    (precise,) = [p for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    parameters = precise["parameters"]
    assert parameters["kvEventsConfig"]["podDiscoveryConfig"]["socketPort"] == 5557
    assert events.topic.startswith(parameters["kvEventsConfig"]["topicFilter"])
    assert parameters["tokenProcessorConfig"]["blockSize"] == 16  # the server's block_size
    (config_map,) = [m for m in of_kind(routed, "ConfigMap") if m["metadata"]["name"] == "rel-loraplex"]
    assert config_map["data"]["LORAPLEX_METRICS_PORT"] == "9090"


def test_the_metrics_port_is_kept_from_clients(routed: list[Manifest]) -> None:
    client_service = named(routed, "Service", "rel-loraplex")
    assert [p["targetPort"] for p in client_service["spec"]["ports"]] == ["http"]
    metrics_service = named(routed, "Service", "rel-loraplex-metrics")
    assert metrics_service["spec"]["clusterIP"] == "None"
    (monitor,) = of_kind(routed, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= metrics_service["metadata"]["labels"].items()
    assert (
        not monitor["spec"]["selector"]["matchLabels"].items() <= client_service["metadata"]["labels"].items()
    )
    policy = named(routed, "NetworkPolicy", "rel-loraplex")
    rules = {tuple(p["port"] for p in rule["ports"]): rule.get("from") for rule in policy["spec"]["ingress"]}
    picker_peer = {
        "podSelector": {"matchLabels": named(routed, "Deployment", PICKER)["spec"]["selector"]["matchLabels"]}
    }
    assert rules[("metrics",)][0] == picker_peer and len(rules[("metrics",)]) == 2  # the picker, Prometheus
    assert rules[("kv-events", "kv-replay")] == [picker_peer]
    # Without a router or Prometheus peers, no rule admits anyone to the metrics port.
    plain = named(render(sets={"networkPolicy.metricsFrom": "null"}), "NetworkPolicy", "rel-loraplex")
    assert all("metrics" not in [p["port"] for p in rule["ports"]] for rule in plain["spec"]["ingress"])


def test_the_validator_refuses_a_broken_pool(routed: list[Manifest]) -> None:
    (pool,) = of_kind(routed, "InferencePool")
    jsonschema.validate(pool, INFERENCE_POOL)
    pool["spec"]["targetPorts"] = []
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, INFERENCE_POOL)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ({"router.enabled": "true", "metricsPort": "null"}, "needs metricsPort"),
        (
            {"router.enabled": "true", "router.picker.prefixScorer": "precise-prefix-cache-scorer"},
            "tokenizer",
        ),
        ({"router.enabled": "true", "router.picker.loraScorer": "round-robin"}, "loraScorer"),
    ],
)
def test_router_values_that_would_break_are_refused(sets: dict[str, str], message: str) -> None:
    with pytest.raises(RenderError, match=message):
        render(sets=sets)


def _spec_names(config: dict[str, Any]) -> dict[str, str]:
    """Each metric spec of the extractor's vllm engine: spec key -> metric name (no label selector)."""
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = [e for e in extractor["parameters"]["engineConfigs"] if e["name"] == "vllm"]
    return {key: value.split("{")[0] for key, value in engine.items() if key.endswith("Spec")}


def test_the_picker_reads_only_metrics_the_server_exports(tiny_dirs: dict[str, Path]) -> None:
    names = _spec_names(picker_config(render(VALUE_SETS["router"])))
    assert {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec"} <= set(
        names
    )
    config = EngineConfig(
        model=str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=32, enable_lora=True, max_lora_rank=8
    )
    engine = AsyncEngine(LLMEngine(config))
    try:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(VLLMCollector(engine, "llama-3.2-1b", 0.9, True))
        exported = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    finally:
        engine.shutdown()
    missing = {key: name for key, name in names.items() if name not in exported}
    assert not missing, f"the picker reads metrics the server does not export: {missing}"
    # The labels it reads off the info-style gauges.
    (cache_info,) = exported["vllm:cache_config_info"].samples
    assert {"block_size", "num_gpu_blocks"} <= set(cache_info.labels)
    (lora_info,) = exported["vllm:lora_requests_info"].samples
    assert set(lora_info.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
