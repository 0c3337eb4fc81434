"""Smoke test: the offline throughput benchmark runs end to end at a tiny scale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.benchmarks import load_benchmark


@pytest.mark.slow
def test_offline_throughput_tiny(tmp_path: Path) -> None:
    bench = load_benchmark("offline_throughput")
    out = tmp_path / "offline_throughput.json"
    plot = tmp_path / "offline_throughput.png"
    report = bench.main(
        [
            "--num-requests", "4",
            "--min-prompt", "8", "--max-prompt", "24",
            "--min-output", "4", "--max-output", "8",
            "--peers", "loraplex,hf_static",
            "--hf-batch-size", "2",
            "--kv-cache-gib", "0.0625",
            "--no-progress",
            "--out", str(out),
            "--plot", str(plot),
        ]
    )  # fmt: skip
    assert out.exists() and plot.exists()
    data = json.loads(out.read_text())
    assert set(report["results"]) == set(data["results"])

    workload_tokens = data["workload"]["output_tokens"]["total"]
    assert set(data["results"]) == {"loraplex", "hf_static"}
    for name, res in data["results"].items():
        assert res["output_tok_s"] > 0, name
        assert res["seconds"] > 0, name
        assert res["output_tokens"] == workload_tokens, name
    assert data["output_token_counts_equal"] is True
    assert set(data["output_token_counts"].values()) == {workload_tokens}
    # Static batches decode to the longest request in the batch: never fewer tokens than requested.
    assert data["results"]["hf_static"]["generated_tokens"] >= workload_tokens

    assert data["ratios"]["hf_static"]["ratio"] > 0
    agree = data["greedy_agreement"]["hf_static"]
    assert agree["num_requests"] == 4 and 0.0 <= agree["positional"] <= 1.0

    kv = data["kv"]
    assert 0 < kv["utilization"]["paged_mean"] <= 1.0
    assert 0 < kv["utilization"]["naive_mean"] <= 1.0
    assert all(v > 0 for v in kv["largest_batch"].values())
