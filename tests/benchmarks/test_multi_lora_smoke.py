"""Smoke test: the multi-LoRA throughput benchmark runs end to end at a tiny scale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.benchmarks import load_benchmark


def test_popularity_matches_slora_formula() -> None:
    bench = load_benchmark("multi_lora_throughput")
    probs = bench.popularity_probs(32, 0.3, "slora")
    assert abs(sum(probs) - 1.0) < 1e-12
    assert probs == sorted(probs, reverse=True)
    assign = bench.assign_adapters(20000, 32, 0.3, "slora", 42)
    hist = bench.adapter_histogram(assign, 32)
    for i in (0, 1, 31):
        assert abs(hist[i] / 20000 - probs[i]) < 0.015, (i, hist[i], probs[i])
    # The same draws serve every N: N = 1 puts everything on adapter 0.
    assert set(bench.assign_adapters(100, 1, 0.3, "slora", 42)) == {0}


def test_many_adapters_flag_points_to_its_own_script(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("multi_lora_throughput")
    with pytest.raises(SystemExit):
        bench.parse_args(["--many-adapters", "256,1024"])
    assert "benchmarks/many_adapters.py" in capsys.readouterr().err


@pytest.mark.slow
def test_multi_lora_throughput_tiny(tmp_path: Path) -> None:
    bench = load_benchmark("multi_lora_throughput")
    out = tmp_path / "multi_lora.json"
    plot = tmp_path / "multi_lora.png"
    report = bench.main(
        [
            "--num-requests", "4",
            "--min-prompt", "8", "--max-prompt", "24",
            "--min-output", "4", "--max-output", "8",
            "--adapters", "1,2",
            "--peft-requests", "2",
            "--peft-batch-size", "2",
            "--kv-cache-gib", "0.0625",
            "--no-progress",
            "--out", str(out),
            "--plot", str(plot),
        ]
    )  # fmt: skip
    assert out.exists() and plot.exists()
    data = json.loads(out.read_text())
    assert data["table"] == report["table"]
    assert data["output_token_counts_equal"] is True

    total = data["workload"]["output_tokens"]["total"]
    base = data["loraplex_base"]
    assert base["output_tok_s"] > 0
    # The base model runs before and after the LoRA runs; the ratios use both, pooled.
    assert base["output_tokens"] == 2 * total
    assert [r["output_tok_s"] > 0 for r in base["pooled_runs"]] == [True, True]
    assert [row["N"] for row in data["table"]] == [1, 2]
    for row in data["table"]:
        assert row["loraplex_tok_s"] > 0
        assert row["peft_tok_s"] > 0
        assert row["ratio_to_base"] > 0 and row["ratio_to_peft"] > 0
    for n in ("1", "2"):
        assert data["loraplex"][n]["output_tok_s"] > 0
        assert data["loraplex"][n]["output_tokens"] == total
        assert data["peft"][n]["output_tok_s"] > 0
        assert data["peft"][n]["num_requests"] == 2
        agree = data["greedy_agreement_vs_peft"][n]
        assert agree["num_requests"] == 2 and 0.0 <= agree["positional"] <= 1.0
    assert data["bar"]["N"] == 2
