"""Smoke test: the prefix-cache benchmark runs end to end on a tiny model at a tiny scale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.benchmarks import load_benchmark


@pytest.mark.slow
def test_prefix_cache_tiny(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    bench = load_benchmark("prefix_cache")
    out = tmp_path / "prefix_cache.json"
    plot = tmp_path / "prefix_cache.png"
    report = bench.main(
        [
            "--model", str(tiny_dirs["gqa_tied"]),
            "--ttft-requests", "3", "--ttft-prefix-len", "48", "--ttft-question-len", "8",
            "--ttft-max-tokens", "2",
            "--restore-prefix-len", "48", "--restore-reps", "2",
            "--restore-disk-dir", str(tmp_path),
            "--conc-requests", "6", "--conc-prefix-len", "64", "--conc-question-len", "8",
            "--conc-max-tokens", "3", "--conc-num-kv-blocks", "20",
            "--conc-host-kv-mib", "1", "--conc-disk-kv-mib", "1",
            "--no-progress",
            "--out", str(out),
            "--plot", str(plot),
        ]
    )  # fmt: skip
    assert out.exists() and plot.exists()
    data = json.loads(out.read_text())
    assert "partial" not in data
    assert set(data["parts"]) == set(report["parts"]) == {"ttft", "restore", "concurrency"}
    machine = data["machine"]
    assert machine["torch_threads"] >= 1 and "torch" in machine and len(machine["loadavg_1_5_15"]) == 3

    ttft = data["parts"]["ttft"]
    assert ttft["ideal_speedup"] == (48 + 8) / 8
    assert ttft["workload"]["expected_cached_tokens"] == 48
    for variant in ("sequential", "batch"):
        v = ttft["variants"][variant]
        # Cached requests hit the whole system prompt; the cache-off engine never hits.
        assert v["on"]["num_cached_tokens"] == [48, 48, 48], variant
        assert v["off"]["num_cached_tokens"] == [0, 0, 0], variant
        assert v["hits_verified"] is True
        assert v["on"]["ttft_s"]["n"] == 3 and v["on"]["ttft_s"]["mean"] > 0
        assert v["speedup"] > 0 and v["fraction_of_ideal"] == v["speedup"] / ttft["ideal_speedup"]
    seq = ttft["variants"]["sequential"]
    assert seq["floor"]["ttft_s"]["n"] == 3 and seq["floor"]["prompt_tokens"] == 8
    assert seq["achievable_speedup"] > 0 and seq["fraction_of_achievable"] > 0
    assert ttft["bar"]["variant"] == "sequential" and isinstance(ttft["bar"]["pass"], bool)

    restore = data["parts"]["restore"]
    variants = restore["variants"]
    assert set(variants) == {"host", "disk_warm", "disk_cold", "recompute"}
    for name in ("host", "disk_warm", "disk_cold"):
        assert variants[name]["verified"] is True, name
        for run in variants[name]["runs"]:
            # The whole prefix came back from the named tier: 3 blocks of 16, promoted from it alone.
            assert run["num_cached_tokens"] == 48, name
            tier = "host" if name == "host" else "disk"
            assert run["promotions"][tier] == 3, name
            assert run["promotions"]["disk" if tier == "host" else "host"] == 0, name
        assert variants[name]["speedup_vs_recompute"] > 0
    assert [r["num_cached_tokens"] for r in variants["recompute"]["runs"]] == [0, 0]
    for run in variants["disk_cold"]["runs"]:
        if run["page_cache_bytes"]["after_drop"] is not None:  # fincore present
            assert run["page_cache_bytes"]["after_drop"] == 0
    assert set(restore["bars"]) == {"host", "disk"} and restore["bars"]["disk"]["variant"] == "disk_cold"
    assert not list(tmp_path.glob("loraplex-prefix-bench-*")), "temporary disk tiers were not removed"

    conc = data["parts"]["concurrency"]
    on, off = conc["runs"]["on"], conc["runs"]["off"]
    assert on["num_cached_tokens_min"] == 64 and off["num_cached_tokens_total"] == 0
    assert on["output_token_counts_ok"] and off["output_token_counts_ok"]
    assert on["output_tokens"] == off["output_tokens"] == 6 * 3
    # 20 blocks: unshared, a request needs 5 (64 + 8 + 3 tokens), so at most 4 run at once;
    # sharing the 4 prefix blocks, each needs 1 more block, so all 6 fit.
    assert off["max_running"] <= 4 < on["max_running"]
    assert conc["ratios"]["max_running"] == on["max_running"] / off["max_running"]
