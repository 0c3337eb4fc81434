"""Smoke test: the structured-output benchmark runs end to end at a tiny scale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.benchmarks import load_benchmark


@pytest.mark.slow
def test_structured_output_tiny(tmp_path: Path) -> None:
    bench = load_benchmark("structured_output")
    out = tmp_path / "structured_output.json"
    report = bench.main(["--concurrency", "2", "--rounds", "1", "--max-tokens", "6", "--out", str(out)])
    data = json.loads(out.read_text())
    result = data["results"]["2"]
    assert set(report["results"]) == {"2"}
    assert result["free_tok_s"] > 0 and result["schema_tok_s"] > 0
    # Both sides made the same tokens: the schema forces answers to run to max_tokens.
    assert result["runs"]["free"][0]["tokens"] == result["runs"]["schema"][0]["tokens"] == 12
    assert result["masks"] == 12 and result["mask_compute_us_per_token_seq"] > 0
