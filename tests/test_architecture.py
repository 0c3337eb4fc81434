"""The architecture contracts in pyproject.toml ([tool.importlinter]) hold, and they bite.

The layers: entry points (CLI, the composition root) -> the admin UI -> HTTP layer / offline API
-> settings -> engine -> model -> kernels, adapters, storage; nothing in the platform imports the
admin UI; kernels and storage never import upward; no cycles among the siblings of the kernels,
the KV storage, its tiers, the HTTP layer or the engine (type-only imports counted); the HTTP layer reaches
the engine only through ``AsyncEngine`` and its public values. The second test adds a forbidden
import to a copy of the package and checks that the same command then fails, so the first cannot
pass vacuously.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_RUN = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(
        [sys.executable, "-c", _RUN, "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_contracts_are_kept() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "forbidden_import", "contract"),
    [
        ("loraplex/kernels/metadata.py", "import loraplex.platform.engine.engine", "Kernels import nothing"),
        ("loraplex/storage/kv/block_pool.py", "import loraplex.adapters.request", "Storage imports nothing"),
        ("loraplex/platform/engine/engine.py", "import loraplex.platform.api.app", "Layers: cli"),
        ("loraplex/kernels/contracts.py", "import loraplex.kernels.registry", "No import cycles"),
        (
            "loraplex/platform/api/routes/models.py",
            "import loraplex.platform.engine.runner",
            "The HTTP layer",
        ),
        ("loraplex/platform/api/deps.py", "import loraplex.storage.kv.block_pool", "The HTTP layer"),
        ("loraplex/platform/api/app.py", "from loraplex import admin_ui", "The admin UI is a client"),
        ("loraplex/admin_ui/views.py", "import loraplex.cli.serve", "Layers: cli"),
        # Type-only imports count: a cycle through one breaks the contract.
        (
            "loraplex/platform/api/errors.py",
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    import loraplex.platform.api.observability.record",
            "No import cycles between the API layer's parts",
        ),
        (
            "loraplex/platform/api/tenancy/gate.py",
            "import loraplex.platform.api.openai.protocol",
            "No import cycles between the API layer's parts",
        ),
        (
            "loraplex/platform/engine/stats.py",
            "import loraplex.platform.engine.engine",
            "No import cycles between the engine's modules",
        ),
        (
            "loraplex/storage/kv/kv_cache.py",
            "import loraplex.storage.kv.tiers.block_codec",
            "No import cycles between the KV storage modules",
        ),
        (
            "loraplex/storage/kv/tiers/transfers.py",
            "import loraplex.storage.kv.tiers.manager",
            "No import cycles between the KV tier modules",
        ),
    ],
)
def test_a_forbidden_import_breaks_a_contract(
    tmp_path: Path, module: str, forbidden_import: str, contract: str
) -> None:
    shutil.copytree(ROOT / "loraplex", tmp_path / "loraplex", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{forbidden_import}  # added by the test\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    broken = [line for line in result.stdout.splitlines() if line.endswith("BROKEN") or " BROKEN (" in line]
    assert any(line.startswith(contract) for line in broken), result.stdout
