"""Smoke test: the step profile runs end to end on a tiny model and a small linear sweep."""

from __future__ import annotations

import json
from pathlib import Path

from support.benchmarks import load_benchmark


def test_step_profile_tiny(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    bench = load_benchmark("step_profile")
    out = tmp_path / "step_profile.json"
    report = bench.main(
        [
            "--model", str(tiny_dirs["gqa_tied"]),
            "--prefix-len", "48", "--question-len", "8", "--requests", "2",
            "--rows", "1,4", "--linear-repeats", "1", "--linear-layers", "1",
            "--out", str(out),
        ]
    )  # fmt: skip
    data = json.loads(out.read_text())
    step = data["step"]
    assert step["num_cached_tokens"] == [48, 48]  # the system prompt came from the cache
    parts = {r["part"]: r for r in step["rows"]}
    # Every timed backend call shows up, once per layer (the tiny model has 2) or per step.
    for name in ("projection qkv", "projection o", "projection gate_up", "projection down", "attention"):
        assert parts[name]["calls_per_request"] == 2 and parts[name]["ms_per_request"] > 0
    assert parts["LM head (1 row)"]["calls_per_request"] == 1
    assert [r["rows"] for r in data["linear"]["rows"]] == [1, 4]
    assert report["linear"]["weight_bytes"] == 4 * sum(o * i for o, i in bench.SMOLLM2_PROJECTIONS.values())
