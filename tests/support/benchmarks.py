"""The benchmark scripts (``benchmarks/*.py``) as modules, for their smoke tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> Any:
    """Import ``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCHMARKS_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
