"""Smoke test: the serving load benchmark runs end to end against loraplex at a tiny scale."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from support.benchmarks import load_benchmark


def test_arrivals_are_poisson_and_seeded() -> None:
    bench = load_benchmark("serve_load")
    arrivals = bench.make_arrivals(4.0, 500.0, 10, 8, seed=3)
    assert arrivals == bench.make_arrivals(4.0, 500.0, 10, 8, seed=3)  # both systems see the same load
    assert abs(len(arrivals) / 500.0 - 4.0) < 0.4
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(arrivals)]
    mean = sum(gaps) / len(gaps)
    assert (
        abs(mean - 0.25) < 0.03
        and abs(math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) - mean) < 0.04
    )


def test_goodput_is_the_best_rate_under_the_slo() -> None:
    bench = load_benchmark("serve_load")
    rows = [
        {"rate": 1, "num_ok": 10, "num_requests": 10, "ttft_p99_s": 0.5, "requests_per_s": 1.0},
        {"rate": 2, "num_ok": 20, "num_requests": 20, "ttft_p99_s": 1.9, "requests_per_s": 1.9},
        {"rate": 4, "num_ok": 40, "num_requests": 40, "ttft_p99_s": 2.5, "requests_per_s": 3.1},
        {"rate": 8, "num_ok": 70, "num_requests": 80, "ttft_p99_s": 1.0, "requests_per_s": 5.0},
    ]
    assert bench.goodput(rows, 2.0)["rate"] == 2
    assert bench.goodput(rows[2:3], 2.0) is None


def test_rate_search_brackets_the_goodput_within_the_ratio() -> None:
    """A system that meets the SLO below 5.3 req/s: the coarse x2 sweep stops at 8 (missed),
    bisection narrows [4, 8] until met and missed are <= 1.25x apart, around 5.3."""
    bench = load_benchmark("serve_load")
    probed: list[float] = []

    def probe(rate: float) -> dict[str, object]:
        probed.append(rate)
        n = max(1, round(10 * rate))
        return {
            "rate": rate,
            "num_ok": n,
            "num_requests": n,
            "ttft_p99_s": 2.0 * rate / 5.3,
            "requests_per_s": rate,
        }

    rows = bench.search_rates(probe, [0.5, 1, 2, 4, 8, 16], 2.0, ratio=1.25)
    assert probed[:5] == [0.5, 1, 2, 4, 8]  # the sweep stops at its first miss
    assert [r["rate"] for r in rows] == sorted(probed)
    best = bench.goodput(rows, 2.0)["rate"]
    missed = min(r for r in probed if r > best)
    assert best < 5.3 <= missed and missed / best <= 1.25
    # Nothing to bisect: a first rate that misses, or a sweep that never misses.
    assert [r["rate"] for r in bench.search_rates(probe, [8, 16], 2.0)] == [8]
    assert [r["rate"] for r in bench.search_rates(probe, [1, 2], 2.0)] == [1, 2]
    with pytest.raises(ValueError):
        bench.search_rates(probe, [1], 2.0, ratio=1.0)


@pytest.mark.slow
def test_serve_load_tiny(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    bench = load_benchmark("serve_load")
    out, plot = tmp_path / "serve_load.json", tmp_path / "serve_load.png"
    report = bench.main(
        [
            "--model", str(tiny_dirs["gqa_tied"]),
            "--systems", "loraplex",
            "--rates", "2,4", "--search-ratio", "2.5",
            "--duration-s", "2",
            "--drain-s", "30",
            "--prompt-words", "8",
            "--max-tokens", "6",
            "--tenants", "2", "--adapters", "1",
            "--out", str(out), "--plot", str(plot),
        ]
    )  # fmt: skip
    assert out.exists() and plot.exists()
    data = json.loads(out.read_text())
    rows = data["results"]["loraplex"]
    assert [r["rate"] for r in rows] == [2.0, 4.0]
    for row in rows:
        assert row["num_ok"] == row["num_requests"] > 0, row["errors"]
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] <= row["e2e_p99_s"]
        assert row["output_tok_s"] > 0
    assert report["goodput"]["loraplex"] is not None
