"""Rendering the Helm chart in tests: helm (fetched by scripts/deploy_tools.sh), value sets, manifests.

helm_binary()                   the helm binary: $LORAPLEX_TOOLS/helm (default .tools/helm),
                                fetched by the script when missing
render(*value_files, set=...)   ``helm template`` -> the manifests as dicts (or the error)
VALUE_SETS                      the chart's value sets under test (helm/loraplex/ci/*.yaml)
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "loraplex"
KUBERNETES_VERSION = "1.36.0"
VALUE_SETS: dict[str, Path | None] = {
    "defaults": None,
    **{path.name.removesuffix("-values.yaml"): path for path in sorted((CHART / "ci").glob("*-values.yaml"))},
}
"""Name -> values file (None: the chart's defaults)."""

Manifest = dict[str, Any]


class RenderError(Exception):
    """``helm template`` refused the values (its message is the exception's)."""


@cache
def helm_binary() -> Path:
    """The helm binary, fetched into the tools folder on first use (a failure fails the tests)."""
    tools = Path(os.environ.get("LORAPLEX_TOOLS") or ROOT / ".tools")
    helm = tools / "helm"
    if not os.access(helm, os.X_OK):
        result = subprocess.run(
            [str(ROOT / "scripts" / "deploy_tools.sh")], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"scripts/deploy_tools.sh could not install helm:\n{result.stderr}")
    return helm


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    """Run helm with ``args`` (never touches a cluster: template and lint only)."""
    return subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, check=False, timeout=120
    )


def value_args(value_file: Path | None, sets: dict[str, str] | None = None) -> list[str]:
    args = [] if value_file is None else ["--values", str(value_file)]
    for key, value in (sets or {}).items():
        args += ["--set", f"{key}={value}"]
    return args


def render(value_file: Path | None = None, sets: dict[str, str] | None = None) -> list[Manifest]:
    """The chart's manifests for these values (hooks and the test Pod included); RenderError if refused."""
    result = helm("template", "rel", str(CHART), "--namespace", "ml", *value_args(value_file, sets))
    if result.returncode != 0:
        raise RenderError(result.stderr.strip())
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def of_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def workload(manifests: list[Manifest]) -> Manifest:
    """The server's Deployment or StatefulSet."""
    (found,) = [
        m
        for m in manifests
        if m["kind"] in ("Deployment", "StatefulSet")
        and m["metadata"]["labels"].get("app.kubernetes.io/component") == "server"
    ]
    return found


def pod_specs(manifests: list[Manifest]) -> Iterator[tuple[str, Manifest]]:
    """(``kind/name``, pod spec) of every workload, Job and Pod rendered."""
    for m in manifests:
        name = f"{m['kind']}/{m['metadata']['name']}"
        if m["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield name, m["spec"]["template"]["spec"]
        elif m["kind"] == "Pod":
            yield name, m["spec"]
