"""No import circle among the project's modules, and nothing in the platform imports the admin UI.

import-linter's contracts (``test_architecture``) check layers and cycles among the siblings of
named packages; this test checks the whole graph, module by module: every import statement
counts, those under ``if TYPE_CHECKING:`` and inside functions included (grimp reads them all),
so a cycle cannot hide behind a type-only or a deferred import. The mutation tests add one
import to a copy of the package and check that the same check then fails.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run in a child process: grimp reads the package found on sys.path, which for the mutation
# tests is a copy of it.
_CHECK = r"""
import sys
import grimp

graph = grimp.build_graph("loraplex", cache_dir=None)
index, low, on_stack, stack, cycles = {}, {}, set(), [], []
sys.setrecursionlimit(10_000)

def visit(module):
    index[module] = low[module] = len(index)
    stack.append(module)
    on_stack.add(module)
    for imported in graph.find_modules_directly_imported_by(module):
        if imported not in index:
            visit(imported)
            low[module] = min(low[module], low[imported])
        elif imported in on_stack:
            low[module] = min(low[module], index[imported])
    if low[module] == index[module]:
        component = []
        while True:
            member = stack.pop()
            on_stack.discard(member)
            component.append(member)
            if member == module:
                break
        if len(component) > 1:
            cycles.append(sorted(component))

for module in sorted(graph.modules):
    if module not in index:
        visit(module)
for component in cycles:
    print("CYCLE", " ".join(component))
for module in sorted(graph.modules):
    if module.startswith("loraplex.platform"):
        for imported in graph.find_modules_directly_imported_by(module):
            if imported == "loraplex.admin_ui" or imported.startswith("loraplex.admin_ui."):
                print("UPWARD", module, "->", imported)
"""


def _check(root: Path) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", _CHECK],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_no_import_cycle_and_no_platform_import_of_the_admin_ui() -> None:
    assert _check(ROOT) == []


@pytest.mark.parametrize(
    ("module", "added", "finding"),
    [
        # A type-only import closing a circle (errors -> the record that notes errors).
        (
            "loraplex/platform/api/errors.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from loraplex.platform.api.observability.record import RequestRecord",
            "CYCLE",
        ),
        # A deferred import inside a function closing a circle (stats -> the engine it describes).
        (
            "loraplex/platform/engine/stats.py",
            "def _late():\n    from loraplex.platform.engine.engine import LLMEngine",
            "CYCLE",
        ),
        ("loraplex/platform/api/app.py", "from loraplex import admin_ui", "UPWARD"),
    ],
)
def test_a_cycle_or_an_upward_import_is_found(tmp_path: Path, module: str, added: str, finding: str) -> None:
    shutil.copytree(ROOT / "loraplex", tmp_path / "loraplex", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n\n{added}  # added by the test\n")
    findings = _check(tmp_path)
    assert any(line.startswith(finding) for line in findings), findings
