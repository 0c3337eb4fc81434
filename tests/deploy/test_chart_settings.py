"""The chart's values and the server's settings cannot drift apart: every setting has a chart value,
every LORAPLEX_* variable the chart sets is a setting, and what the chart renders loads as settings."""

from __future__ import annotations

import importlib.util
import re
import sys
from types import ModuleType
from typing import Any

import pytest
import yaml
from support.charts import CHART, ROOT, VALUE_SETS, Manifest, of_kind, pod_specs, render

from loraplex.platform.settings import ENV_PREFIX, all_fields, load_settings


def chart_settings() -> ModuleType:
    """scripts/chart_settings.py as a module."""
    spec = importlib.util.spec_from_file_location("chart_settings", ROOT / "scripts" / "chart_settings.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("chart_settings", module)
    spec.loader.exec_module(module)
    return module


_OURS = ("server", "migrate", "test")
"""Components running loraplex (the in-chart PostgreSQL and Redis have their own variables)."""


def chart_env(manifests: list[Manifest]) -> dict[str, dict[str, str]]:
    """Every environment variable the chart sets for loraplex, by where: the ConfigMaps' and
    Secrets' keys (which pods take whole, with envFrom) and each container's ``env``."""
    ours = [m for m in manifests if m["metadata"]["labels"]["app.kubernetes.io/component"] in _OURS]
    found: dict[str, dict[str, str]] = {}
    for m in of_kind(ours, "ConfigMap"):
        found[f"ConfigMap/{m['metadata']['name']}"] = dict(m.get("data", {}))
    for m in of_kind(ours, "Secret"):
        found[f"Secret/{m['metadata']['name']}"] = dict(m.get("stringData", {}))
    for name, spec in pod_specs(ours):
        for container in spec["containers"]:
            env = {e["name"]: e.get("value", "<from>") for e in container.get("env", [])}
            found[f"{name}/{container['name']}"] = env
    return found


def test_generated_values_and_schema_are_current() -> None:
    assert chart_settings().main(["--check"]) == 0, "run: python scripts/chart_settings.py"


def test_every_setting_has_a_chart_value() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    managed = set(chart_settings().MANAGED)
    settings = set(all_fields())
    assert managed <= settings, managed - settings
    assert set(values["config"]) == settings - managed
    assert all(value is None for value in values["config"].values())  # the server's defaults rule


def test_a_new_setting_makes_the_check_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    module = chart_settings()
    fields = module.all_fields()
    extra = fields["max_num_seqs"].__class__(
        "engine", "max_widgets", int, 3, "3", "A setting someone just added."
    )
    monkeypatch.setattr(module, "all_fields", lambda: {**fields, "max_widgets": extra})
    assert module.main(["--check"]) == 1
    assert "max_widgets: null" in module.config_block()


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_variable_the_chart_sets_is_a_setting(name: str) -> None:
    known = {f.env for f in all_fields().values()}
    for where, env in chart_env(render(VALUE_SETS[name])).items():
        ours = {key for key in env if key.startswith(ENV_PREFIX)}
        assert ours <= known, f"{where}: {sorted(ours - known)} are not settings"
        # The only other variables: the in-chart database's password, the test Pod's own, the
        # pod's IP (expanded into the KV events' topic) and the endpoint picker's own.
        others = {"PGPASSWORD", "BASE", "PROMPT", "POD_IP"}
        if where.startswith("Deployment/rel-loraplex-epp/"):
            others |= {"NAMESPACE", "POD_NAME"}
        assert set(env) - ours <= others, where


def test_the_managed_settings_are_set_by_the_chart() -> None:
    managed = {all_fields()[name].env for name in chart_settings().MANAGED}
    seen: set[str] = set()
    for path in VALUE_SETS.values():
        for env in chart_env(render(path)).values():
            seen |= set(env)
    assert managed <= seen, managed - seen


_EXISTING_SECRET = {
    "LORAPLEX_ADMIN_TOKEN": "an-operators-token-of-32-chars!!",
    "LORAPLEX_DATABASE_URL": "postgresql+asyncpg://loraplex:pw@db:5432/loraplex",
    "LORAPLEX_REDIS_URL": "redis://redis:6379/0",
}
"""What an operator's existingSecret holds (docs/deployment.md), for the value sets that name one."""


def _server_environ(manifests: list[Manifest]) -> dict[str, str]:
    """The environment the server container gets (envFrom, then env, $(VAR) expanded)."""
    config_maps = {m["metadata"]["name"]: m.get("data", {}) for m in of_kind(manifests, "ConfigMap")}
    secrets = {m["metadata"]["name"]: m.get("stringData", {}) for m in of_kind(manifests, "Secret")}
    (container,) = [
        c
        for m in manifests
        if m["kind"] in ("Deployment", "StatefulSet")
        and m["metadata"]["labels"]["app.kubernetes.io/component"] == "server"
        for c in m["spec"]["template"]["spec"]["containers"]
    ]
    environ: dict[str, str] = {}
    for source in container["envFrom"]:
        if "configMapRef" in source:
            environ.update(config_maps[source["configMapRef"]["name"]])
        else:
            environ.update(secrets.get(source["secretRef"]["name"], _EXISTING_SECRET))
    for item in container.get("env", []):
        value = item.get("value") or "trial-password"
        environ[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: environ[m.group(1)], value)
    return environ


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_what_the_chart_renders_loads_as_settings(name: str) -> None:
    environ = _server_environ(render(VALUE_SETS[name]))
    settings = load_settings(environ=environ).settings
    values: dict[str, Any] = yaml.safe_load(VALUE_SETS[name].read_text()) if VALUE_SETS[name] else {}
    for key, value in values.get("config", {}).items():
        loaded = settings.value(key)
        assert str(loaded) == str(value) or loaded == value or all_fields()[key].is_bytes, (
            key,
            loaded,
            value,
        )
    assert settings.serving.host == "0.0.0.0" and settings.serving.port == 8000
    assert str(settings.gateway.adapter_store) == "/var/lib/loraplex-adapters"
    if name == "cpu-trial":
        assert settings.gateway.database_url == (
            "postgresql+asyncpg://loraplex:trial-password@rel-loraplex-postgresql:5432/loraplex"
        )
        assert settings.gateway.redis_url == "redis://rel-loraplex-redis:6379/0"
        assert settings.engine.kv_cache_memory == 1 << 30
    if name == "production-gpu":
        assert settings.engine.max_num_seqs == 256 and settings.engine.gpu_memory_utilization == 0.85
        assert settings.engine.host_kv_cache_bytes == 16 << 30
        assert settings.gateway.max_upload_bytes == 1073741824  # not 1.073741824e+09
    if name == "disk-kv-statefulset":
        assert settings.engine.disk_kv_path == "/var/lib/loraplex-kv"
        assert settings.engine.disk_kv_cache_bytes == 90 << 30
