"""The test session: the shared fixture plugins (``tests/support``), markers by folder, torch threads.

``tests/`` is on pytest's ``pythonpath`` (pyproject.toml), so tests import helpers as
``from support.<module> import ...`` and no file edits ``sys.path``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.register_assert_rewrite("support")  # a helper's failed assert shows its values, as a test's does

# Fixtures of every test: tiny models, databases (SQLite and PostgreSQL), Redis, the gateway.
pytest_plugins = ["support.models", "support.databases", "support.redis", "support.gateway"]

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

TESTS_DIR = Path(__file__).parent
# Every test under a folder gets its marker: ``-m "not e2e"`` leaves out the real-server tests.
MARKERS_BY_FOLDER = {"e2e": "e2e", "deploy": "deploy"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.relative_to(TESTS_DIR).parts if item.path.is_relative_to(TESTS_DIR) else ()
        if parts and parts[0] in MARKERS_BY_FOLDER:
            item.add_marker(MARKERS_BY_FOLDER[parts[0]])
