"""Session fixtures: the bundled SmolLM2 as an HF directory, and tiny random models."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # for tests/helpers.py
# Fixtures of real services: databases (services_fixtures), Redis (redis_starter).
pytest_plugins = ["services_fixtures", "redis_starter"]

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from loraplex.platform.model.source import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> dict[str, Path]:
    """Tiny random models covering MHA, GQA, tied embeddings and q/k/v bias."""
    from helpers import make_tiny_model_dir

    root = tmp_path_factory.mktemp("tiny")
    specs = {
        "mha_untied": dict(heads=4, kv_heads=4, tie=False),
        "gqa_tied": dict(heads=4, kv_heads=2, tie=True, seed=1),
        "gqa3_bias": dict(heads=6, kv_heads=2, hidden=96, bias=True, seed=2),
        "qwen2": dict(model_type="qwen2", heads=4, kv_heads=2, seed=3),
        "llama3_rope": dict(
            heads=4,
            kv_heads=1,
            seed=4,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    }
    return {name: make_tiny_model_dir(root / name, smollm2_dir, **kw) for name, kw in specs.items()}  # type: ignore[arg-type]
