"""The Helm chart: lint, render and validate every value set for Kubernetes 1.36, and check what the
chart promises (probes, security, the shutdown budget, the migration hook, refused combinations)."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
from support.charts import (
    CHART,
    KUBERNETES_VERSION,
    VALUE_SETS,
    Manifest,
    RenderError,
    helm,
    of_kind,
    pod_specs,
    render,
    value_args,
    workload,
)
from support.crd_schemas import CUSTOM_RESOURCES

from loraplex.platform.settings import all_fields

SETS = list(VALUE_SETS)


@pytest.fixture(scope="module", params=SETS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[Manifest]]:
    return request.param, render(VALUE_SETS[request.param])


def server_container(manifests: list[Manifest]) -> Manifest:
    (container,) = workload(manifests)["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("name", SETS)
def test_lint_strict(name: str) -> None:
    result = helm("lint", "--strict", str(CHART), *value_args(VALUE_SETS[name]))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_every_manifest_validates_for_kubernetes_1_36(rendered: tuple[str, list[Manifest]]) -> None:
    name, manifests = rendered
    assert manifests, name
    for manifest in manifests:
        schema = CUSTOM_RESOURCES.get((manifest["apiVersion"], manifest["kind"]))
        if schema is not None:
            jsonschema.validate(manifest, schema)
        else:  # SchemaNotFoundError for anything else unknown: no kind goes unchecked
            kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def test_the_validator_refuses_a_broken_manifest() -> None:
    deployment = workload(render())
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_value_sets_render_what_they_promise() -> None:
    kinds = {name: {m["kind"] for m in render(path)} for name, path in VALUE_SETS.items()}
    production = kinds["production-gpu"]
    assert {"Deployment", "HorizontalPodAutoscaler", "Ingress", "ServiceMonitor", "Job"} <= production
    assert {"PodDisruptionBudget", "NetworkPolicy", "PersistentVolumeClaim", "Secret"} <= production
    assert "StatefulSet" in kinds["disk-kv-statefulset"] and "Deployment" not in kinds["disk-kv-statefulset"]
    assert "ScaledObject" in kinds["keda"] and "HorizontalPodAutoscaler" not in kinds["keda"]
    trial = render(VALUE_SETS["cpu-trial"])
    components = {m["metadata"]["labels"]["app.kubernetes.io/component"] for m in trial}
    assert {"postgresql", "redis", "server"} <= components


def test_probes_wait_for_the_model_and_liveness_is_health(rendered: tuple[str, list[Manifest]]) -> None:
    container = server_container(rendered[1])
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # a model load of minutes


def test_pods_run_restricted(rendered: tuple[str, list[Manifest]]) -> None:
    for name, spec in pod_specs(rendered[1]):
        pod_context = spec.get("securityContext", {})
        assert pod_context.get("runAsNonRoot") is True, name
        assert pod_context.get("seccompProfile") == {"type": "RuntimeDefault"}, name
        # Only the endpoint picker talks to the Kubernetes API (it watches the pool's pods).
        picker = name == "Deployment/rel-loraplex-epp"
        assert spec.get("automountServiceAccountToken") is picker, name
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            assert "limits" in container["resources"] and "requests" in container["resources"], name


def test_writable_paths_are_volumes(rendered: tuple[str, list[Manifest]]) -> None:
    mounts = {m["mountPath"] for m in server_container(rendered[1])["volumeMounts"]}
    assert {"/var/lib/loraplex", "/var/cache/loraplex", "/tmp", "/var/lib/loraplex-adapters"} <= mounts


def _grace(manifests: list[Manifest]) -> int:
    """The shutdown grace the server will run with: the rendered setting, else the model's default
    (so a changed default fails here until the chart's ``loraplex.shutdownGrace`` follows it)."""
    (config_map,) = [m for m in of_kind(manifests, "ConfigMap") if m["metadata"]["name"] == "rel-loraplex"]
    fields = all_fields()
    (name,) = [n for n in ("shutdown_grace_s", "graceful_shutdown_s") if n in fields][:1]
    return int(config_map["data"].get(fields[name].env) or fields[name].default)


def test_termination_grace_covers_the_shutdown_grace(rendered: tuple[str, list[Manifest]]) -> None:
    manifests = rendered[1]
    pod = workload(manifests)["spec"]["template"]["spec"]
    sleep = server_container(manifests)["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > _grace(manifests) + sleep


def test_a_termination_grace_below_the_shutdown_grace_is_refused() -> None:
    with pytest.raises(RenderError, match="terminationGracePeriodSeconds"):
        render(sets={"terminationGracePeriodSeconds": "12"})  # 10 s grace + 5 s preStop sleep
    pod = workload(render(sets={"terminationGracePeriodSeconds": "16"}))["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 16


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ({"replicaCount": "3"}, "shared database"),
        (
            {"replicaCount": "3", "database.url": "sqlite+aiosqlite:////x.db", "redis.url": "redis://r:6379"},
            "needs PostgreSQL",
        ),
        ({"replicaCount": "2", "database.url": "postgresql+asyncpg://u@db/x"}, "shared Redis"),
        (
            {
                "replicaCount": "2",
                "existingSecret": "s",
                "adapterStore.persistence.accessModes[0]": "ReadWriteOnce",
            },
            "ReadWriteMany",
        ),
        ({"existingSecret": "s", "autoscaling.enabled": "true", "keda.enabled": "true"}, "choose one"),
        ({"kvCache.disk.enabled": "true"}, "disk_kv_cache_bytes"),
        (
            {
                "existingSecret": "s",
                "autoscaling.enabled": "true",
                "autoscaling.targetCPUUtilizationPercentage": "null",
            },
            "needs a metric",
        ),
        ({"config.max_num_seq": "4"}, "max_num_seq"),  # a misspelt setting: the schema refuses it
        ({"config.max_num_seqs": "many"}, "max_num_seqs"),
    ],
)
def test_combinations_that_would_break_are_refused(sets: dict[str, str], message: str) -> None:
    with pytest.raises(RenderError, match=message):
        render(sets=sets)


def test_gpu_values_ask_for_a_gpu() -> None:
    manifests = render(VALUE_SETS["production-gpu"])
    container = server_container(manifests)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"].endswith(":0.1.0-cuda")
    pod = workload(manifests)["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia" and pod["tolerations"] and pod["nodeSelector"]
    assert "nvidia.com/gpu" not in server_container(render())["resources"].get("limits", {})


def test_the_adapter_store_is_shared_and_the_disk_tier_per_replica() -> None:
    production = render(VALUE_SETS["production-gpu"])
    (claim,) = of_kind(production, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    statefulset = workload(render(VALUE_SETS["disk-kv-statefulset"]))
    (template,) = statefulset["spec"]["volumeClaimTemplates"]
    assert template["metadata"]["name"] == "kv-disk" and template["spec"]["accessModes"] == ["ReadWriteOnce"]
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    assert volumes["adapters"]["persistentVolumeClaim"]["claimName"] == "loraplex-adapters"
    assert "kv-disk" not in volumes  # from the claim template
    keda = {v["name"]: v for v in workload(render(VALUE_SETS["keda"]))["spec"]["template"]["spec"]["volumes"]}
    assert keda["kv-disk"]["emptyDir"]["sizeLimit"] == "20Gi"


def test_migrations_run_once_in_a_hook_job() -> None:
    production = render(VALUE_SETS["production-gpu"])
    (job,) = of_kind(production, "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["db", "upgrade"]
    (url,) = container["env"]
    secret_name = url["valueFrom"]["secretKeyRef"]["name"]
    (hook_secret,) = [m for m in of_kind(production, "Secret") if m["metadata"]["name"] == secret_name]
    assert hook_secret["metadata"]["annotations"]["helm.sh/hook-weight"] == "-10"  # made before the Job
    assert hook_secret["stringData"]["LORAPLEX_DATABASE_URL"].startswith("postgresql+asyncpg://")
    # An existing Secret is used as it is; the in-chart trial database exists only after install,
    # so there the servers' start-up lock migrates; SQLite has nothing to share.
    (job,) = of_kind(render(VALUE_SETS["disk-kv-statefulset"]), "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"] == {
        "name": "loraplex-secrets",
        "key": "LORAPLEX_DATABASE_URL",
    }
    assert not of_kind(render(VALUE_SETS["cpu-trial"]), "Job")
    assert not of_kind(render(), "Job")


def test_helm_test_hook_checks_ready_and_a_completion() -> None:
    (pod,) = of_kind(render(), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["args"][0]
    assert '"/ready"' in script and '"/v1/completions"' in script
    compile(script, "helm-test", "exec")  # the script at least parses


def test_config_and_secret_changes_roll_the_pods() -> None:
    def annotations(sets: dict[str, str]) -> dict[str, str]:
        return workload(render(sets=sets))["spec"]["template"]["metadata"]["annotations"]

    base = annotations({"adminToken": "a" * 32})
    assert (
        annotations({"adminToken": "a" * 32, "config.max_num_seqs": "8"})["checksum/config"]
        != base["checksum/config"]
    )
    assert annotations({"adminToken": "b" * 32})["checksum/secret"] != base["checksum/secret"]


def test_schema_file_is_the_one_helm_reads() -> None:
    assert (CHART / "values.schema.json").is_file()
    assert Path(CHART / "templates" / "NOTES.txt").is_file()


def test_a_restricted_ingress_still_admits_the_helm_test_pod() -> None:
    manifests = render(VALUE_SETS["production-gpu"])
    (policy,) = [m for m in of_kind(manifests, "NetworkPolicy") if m["metadata"]["name"] == "rel-loraplex"]
    peers = policy["spec"]["ingress"][0]["from"]
    (test_pod,) = of_kind(manifests, "Pod")
    test_labels = test_pod["metadata"]["labels"]
    admitted = [
        p
        for p in peers
        if "podSelector" in p and p["podSelector"]["matchLabels"].items() <= test_labels.items()
    ]
    assert admitted and any("namespaceSelector" in p for p in peers)
