"""Smoke test: the many-adapters benchmark (issue 29) at a tiny scale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.benchmarks import load_benchmark


def test_uniform_mix_gives_each_adapter_one_or_two_requests() -> None:
    bench = load_benchmark("many_adapters")
    for n, r in ((256, 384), (1024, 1536), (64, 128), (16, 16)):
        assign = bench.uniform_assignment(r, n, 42)
        hist = bench.adapter_histogram(assign, n)
        assert len(assign) == r and min(hist) >= 1 and max(hist) == -(-r // n), (n, r)
    # Fewer requests than adapters: every request its own adapter.
    assert len(set(bench.uniform_assignment(128, 256, 42))) == 128
    assert bench.uniform_assignment(100, 50, 7) == bench.uniform_assignment(100, 50, 7)


def test_engine_args_pass_max_loras_only_for_a_cap() -> None:
    bench = load_benchmark("many_adapters")
    args = bench.parse_args(["--many-adapters", "256,1024", "--configs", "default,4,32"])
    assert args.configs == [None, 4, 32]
    assert (args.rank, args.lora_alpha, args.target_modules) == (8, 16, ["q_proj", "v_proj"])
    default = bench.many_engine_args(args, None)
    assert "max_loras" not in default and "max_cpu_loras" not in default and "max_lora_rank" not in default
    assert default["enable_lora"] is True and default["enable_prefix_caching"] is False
    assert bench.many_engine_args(args, 4)["max_loras"] == 4
    assert bench.many_requests(args, 256) == 384  # 1.5 requests per adapter
    with pytest.raises(SystemExit):
        bench.parse_args(["--many-adapters", "8", "--configs", "default,x"])


@pytest.mark.slow
def test_time_limited_run_stops_and_frees_what_it_cut(tiny_dirs: dict[str, Path]) -> None:
    from loraplex import LLM

    runs = load_benchmark("many_adapters_runs")  # puts the repository root on sys.path
    from benchmarks.common import random_token_workload
    from benchmarks.lora_runs import aligned

    llm = LLM(str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    wl = random_token_workload(6, (8, 16), (32, 32), 49152, seed=3)
    full = runs.run_loraplex_once(llm, "full", wl, [None] * 6, False)
    cut = runs.run_loraplex_timed(llm, "cut", wl, [None] * 6, 0.0)  # one step, then the limit
    assert cut.extra["finished_requests"] == 0 and not llm.llm_engine.has_unfinished_requests()
    assert 0 < cut.output_tokens < full.output_tokens
    assert cut.extra["engine_steps"] == 1 and full.extra["engine_steps"] > 1
    # What the cut run generated is the start of what the full run generated.
    x, y = aligned(full.outputs, cut.outputs)
    assert x == y and len(x) == sum(1 for o in cut.outputs if o)
    # Every device block is free again (EngineStats.kv, published after the aborts).
    kv = runs.engine_stats(llm.llm_engine).kv
    assert kv.num_used_device_blocks == kv.num_adapter_device_blocks == 0


@pytest.mark.slow
def test_many_adapters_tiny(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    bench = load_benchmark("many_adapters")
    out = tmp_path / "many.json"
    plot = tmp_path / "many.png"
    report = bench.main(
        [
            "--model", str(tiny_dirs["gqa_tied"]),
            "--many-adapters", "4,8",
            "--configs", "8,2",  # 8 >= the largest N: stands in for the default; 2: a slot cap
            "--capped-requests", "4", "--capped-seconds", "120",  # the timed path; ends well before
            "--min-prompt", "8", "--max-prompt", "24",
            "--min-output", "4", "--max-output", "8",
            "--init-std", "0.3",  # strong adapters: a wrong one would change the tokens
            "--ttft-probes", "1", "--ttft-prompt", "16",
            "--many-peft-requests", "4", "--peft-batch-size", "2",
            "--kv-cache-gib", "0.0625",
            "--no-progress",
            "--out", str(out),
            "--plot", str(plot),
        ]
    )  # fmt: skip
    assert out.exists() and plot.exists() and out.with_suffix(".md").exists()
    data = json.loads(out.read_text())
    assert data["benchmark"] == "many_adapters" and data["table"] == report["table"]
    assert data["output_token_counts_equal"] is True
    assert data["requests_per_n"] == {"4": 6, "8": 12}
    assert data["mixes"]["N=8 uniform"] == {"requests_per_adapter_used": [1, 2], "distinct_adapters": 8}

    rows = {(r["config"], r["N"], r["mix"]): r for r in data["table"]}
    assert set(rows) == {
        (c, n, m) for c in ("max_loras=8", "max_loras=2") for n in (4, 8) for m in bench.MIXES
    }
    for (config, n, _mix), row in rows.items():
        assert row["loraplex_tok_s"] > 0 and row["base_tok_s"] > 0 and row["ratio_to_base"] > 0
        assert row["capped"] == (config == "max_loras=2")
        assert row["requests"] == (4 if config == "max_loras=2" else {4: 6, 8: 12}[n])
        assert row["finished_requests"] == row["requests"]
    assert data["configs"]["max_loras=8"]["request_limit"] is None
    assert data["configs"]["max_loras=8"]["time_limit_s"] is None
    assert data["configs"]["max_loras=2"]["time_limit_s"] == 120
    assert data["configs"]["max_loras=2"]["engine_args"]["max_loras"] == 2
    # The engine's EngineStats.adapters at each configuration's end, and what its limits resolved to.
    stats = data["configs"]["max_loras=2"]["adapter_stats"]
    assert stats["max_loras"] == 2 and stats["num_registered"] >= 9 and stats["num_slot_loads"] > 0
    assert data["configs"]["max_loras=2"]["resolved"]["max_loras"] == 2
    # What the adapter tiers did in each run (counters named loads / reads / evictions).
    assert all(isinstance(run["adapter_moves"], dict) for run in data["runs"].values())
    for base in data["base"].values():
        assert base["outputs_identical_before_after"] is True and len(base["pooled_runs"]) == 2

    # The same requests on the same adapters give the same greedy tokens with 2 slots as with 8,
    # and the same as PEFT; the adapters change the base model's tokens.
    assert len(data["greedy_agreement_vs_first_config"]) == 4
    for agree in data["greedy_agreement_vs_first_config"].values():
        assert agree["num_requests"] == 4 and agree["num_tokens"] > 0 and agree["exact_requests"] == 1.0
    peft = data["peft_reference"]
    assert peft["agreement"]["num_requests"] == 4 and peft["agreement"]["exact_requests"] == 1.0
    assert peft["peft_vs_base"]["positional"] < 1.0
    assert min(e["positional_same_as_base"] for e in data["adapter_effect_vs_base"].values()) < 1.0

    for info in data["configs"].values():
        ttft = info["ttft"]["summary"]
        assert ttft["tiers_before"] and set(ttft["tiers_before"]) <= {"disk", "host", "device"}
        for key in ("registered_unused_ms", "loaded_ms", "base_ms", "first_use_ms"):
            assert ttft[key] > 0, key
