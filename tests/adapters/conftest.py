"""Fixtures for the adapter tests: the tiny base model's spec and managers with a private store."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.adapters import tiny_spec

from loraplex.adapters import AdapterManager, AdapterManagerConfig, BaseModelSpec

_QUIET = (
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",
    "ignore:Setting `save_embedding_layers`:UserWarning",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Silence transformers/peft deprecation chatter in these tests only (not our warnings)."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            for spec in _QUIET:
                item.add_marker(pytest.mark.filterwarnings(spec))


@pytest.fixture(scope="session")
def spec() -> BaseModelSpec:
    return tiny_spec()


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def make_manager(spec: BaseModelSpec, store_dir: Path) -> Iterator[Callable[..., AdapterManager]]:
    """Build managers over the tiny spec (store in ``store_dir`` unless given); closed after the test."""
    managers: list[AdapterManager] = []

    def factory(**kwargs: Any) -> AdapterManager:
        extra = {name: kwargs.pop(name) for name in ("dtype", "weight_layout", "arena") if name in kwargs}
        kwargs.setdefault("store_dir", store_dir)
        kwargs.setdefault("max_loras", 2)
        kwargs.setdefault("max_lora_rank", 8)
        kwargs.setdefault("max_cpu_loras", 4)
        manager = AdapterManager(spec, AdapterManagerConfig(**kwargs), **extra)
        managers.append(manager)
        return manager

    yield factory
    for manager in managers:
        manager.close()
