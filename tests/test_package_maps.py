"""Package maps stay true: a package whose docstring has a ``| module | ... |`` table names every
module and sub-package in it, and names nothing that is not there.

The HTTP layer and its sub-packages, the settings, the CLI and the engine must have a map: they
are where a newcomer starts reading, and a module missing from the map is a module nobody finds.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "loraplex"
MUST_HAVE_A_MAP = (
    "platform/api",
    "platform/api/openai",
    "platform/api/tenancy",
    "platform/api/tenancy/quotas",
    "platform/api/catalog",
    "platform/api/services",
    "platform/api/routes",
    "platform/settings",
    "cli",
    "platform/engine",
    "storage/kv",
    "storage/kv/tiers",
)
_ROW = re.compile(r"^\|\s*(.+?)\s*\|", re.MULTILINE)
_NAME = re.compile(r"``([A-Za-z_][A-Za-z0-9_]*)/?``")


def _map_names(init: Path) -> set[str] | None:
    """The names in the first column of the package docstring's module table (None: no table)."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    if "| module |" not in doc:
        return None
    names: set[str] = set()
    for cell in _ROW.findall(doc):
        names.update(_NAME.findall(cell))
    return names


def _children(folder: Path) -> set[str]:
    modules = {p.stem for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    packages = {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
    return modules | packages


def _packages() -> list[Path]:
    return sorted(init.parent for init in PACKAGE.rglob("__init__.py"))


@pytest.mark.parametrize("folder", _packages(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_package_map_names_every_module(folder: Path) -> None:
    names = _map_names(folder / "__init__.py")
    where = str(folder.relative_to(PACKAGE))
    if names is None:
        assert where not in MUST_HAVE_A_MAP, f"loraplex/{where}/__init__.py needs a '| module |' table"
        return
    children = _children(folder)
    missing = sorted(children - names)
    assert not missing, f"loraplex/{where}: modules missing from the package map: {missing}"
    stale = sorted(names - children)
    assert not stale, f"loraplex/{where}: the package map names modules that do not exist: {stale}"
