"""The multi-LoRA throughput benchmark's checks, table, bar, JSON and plot
(``multi_lora_throughput.py`` runs; this reports)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Workload, format_table, machine_info, token_agreement, write_json
from benchmarks.lora_runs import RunResult, command_line
from benchmarks.lora_workloads import adapter_histogram

SCRIPT = "multi_lora_throughput"
BAR_VS_BASE = 0.7  # at the largest N: loraplex LoRA >= 0.7 x loraplex base
BAR_VS_PEFT = 4.0  # at the largest N: loraplex LoRA >= 4 x PEFT
BAR_N = 32


def report(
    args: argparse.Namespace,
    argv: list[str] | None,
    wl: Workload,
    sub: Workload,
    assignments: dict[int, list[int]],
    lp: dict[str, RunResult],
    peft: dict[str, RunResult],
    eargs: dict[str, Any],
    *,
    warm_s: float,
    peft_load_s: float,
    size_mb: float,
    make_s: float,
) -> dict[str, Any]:
    """Print the checks and the table, write the JSON (and ``--plot``); ``lp``: loraplex's runs by
    N and ``base`` (the pooled base runs), ``peft``: PEFT's by N on ``sub``."""
    base = lp["base"]
    n_max = max(args.adapters)
    # ---- checks ------------------------------------------------------------------------------
    counts_ok = all([len(o) for o in r.outputs] == wl.max_tokens for r in lp.values()) and all(
        [len(o) for o in r.outputs] == sub.max_tokens for r in peft.values()
    )
    print(f"\noutput token counts equal to the workload's: {counts_ok}")
    agreement: dict[str, Any] = {}
    adapter_effect: dict[str, Any] = {}
    for n in args.adapters:
        if str(n) in peft:
            k = len(sub)
            a = token_agreement(peft[str(n)].outputs, lp[str(n)].outputs[:k])
            agreement[str(n)] = a
            # The adapters must matter: PEFT-with-adapter vs loraplex base on the same requests.
            d = token_agreement(peft[str(n)].outputs, base.outputs[:k])
            adapter_effect[str(n)] = {"positional_same_as_base": d["positional"], "prefix": d["prefix"]}
            print(
                f"greedy agreement loraplex vs PEFT, N={n} ({a['num_requests']} requests, {args.dtype}): "
                f"{a['positional']:.1%} position-wise, {a['prefix']:.1%} before the first divergence, "
                f"{a['exact_requests']:.1%} of requests identical "
                f"(vs base model: {d['positional']:.1%} position-wise)"
            )

    # ---- table -------------------------------------------------------------------------------
    rows_json = []
    rows = []
    for n in args.adapters:
        r = lp[str(n)]
        pr = peft.get(str(n))
        ratio_base = r.tok_s / base.tok_s
        ratio_base_cpu = r.tok_cpu_s / base.tok_cpu_s if base.tok_cpu_s else 0.0
        ratio_peft = r.tok_s / pr.tok_s if pr and pr.tok_s else None
        rows_json.append(
            {
                "N": n,
                "loraplex_tok_s": round(r.tok_s, 2),
                "loraplex_tok_per_cpu_s": round(r.tok_cpu_s, 2),
                "ratio_to_base": round(ratio_base, 3),
                "ratio_to_base_cpu": round(ratio_base_cpu, 3),
                "peft_tok_s": round(pr.tok_s, 2) if pr else None,
                "peft_tok_per_cpu_s": round(pr.tok_cpu_s, 2) if pr else None,
                "ratio_to_peft": round(ratio_peft, 2) if ratio_peft else None,
                "distinct_adapters_used": len(set(assignments[n])),
            }
        )
        rows.append(
            [
                n,
                f"{r.tok_s:.1f}",
                f"{ratio_base:.2f}x",
                f"{ratio_base_cpu:.2f}x",
                f"{pr.tok_s:.2f}" if pr else "-",
                f"{ratio_peft:.1f}x" if ratio_peft else "-",
            ]
        )
    print(f"\nloraplex base model: {base.tok_s:.1f} output tok/s ({base.tok_cpu_s:.1f} per CPU-s)")
    print(
        format_table(
            ["N", "loraplex tok/s", "/ base", "/ base (CPU-s)", f"PEFT tok/s ({len(sub)} req)", "/ PEFT"],
            rows,
        )
    )
    at = str(BAR_N) if str(BAR_N) in lp else str(n_max)
    row = next(r for r in rows_json if str(r["N"]) == at)
    bar = {
        "N": int(at),
        "ratio_to_base": row["ratio_to_base"],
        "ratio_to_base_bar": BAR_VS_BASE,
        "pass_base": row["ratio_to_base"] >= BAR_VS_BASE,
        "ratio_to_peft": row["ratio_to_peft"],
        "ratio_to_peft_bar": BAR_VS_PEFT,
        "pass_peft": row["ratio_to_peft"] is not None and row["ratio_to_peft"] >= BAR_VS_PEFT,
    }
    print(
        f"bar at N={at}: {row['ratio_to_base']:.2f}x base (>= {BAR_VS_BASE}: "
        f"{'PASS' if bar['pass_base'] else 'FAIL'}), "
        + (
            f"{row['ratio_to_peft']:.1f}x PEFT (>= {BAR_VS_PEFT}: {'PASS' if bar['pass_peft'] else 'FAIL'})"
            if row["ratio_to_peft"] is not None
            else "PEFT not run"
        )
    )

    data: dict[str, Any] = {
        "benchmark": SCRIPT,
        "command": command_line(SCRIPT, argv),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "settings": vars(args),
        "workload": wl.summary(),
        "peft_subset": sub.summary() if peft else None,
        "adapters": {
            "count": n_max,
            "rank": args.rank,
            "lora_alpha": args.lora_alpha,
            "target_modules": list(args.target_modules),
            "init": f"A, B ~ N(0, {args.init_std}^2), seed {args.adapter_seed} + index",
            "size_mib_each": round(size_mb, 2),
            "make_seconds": round(make_s, 2),
        },
        "popularity": {
            "kind": args.popularity,
            "alpha": args.alpha,
            "formula": "P(i) = ((i+1)/N)^alpha - (i/N)^alpha  (adapter floor(N*x), x ~ numpy power(alpha))"
            if args.popularity == "slora"
            else "P(i) ∝ (i+1)^-alpha",
            "requests_per_adapter": {str(n): adapter_histogram(assignments[n], n) for n in args.adapters},
        },
        "engine_args": eargs,
        "loraplex_warmup_seconds": round(warm_s, 2),
        "peft_load_seconds": round(peft_load_s, 2),
        "loraplex_base": base.summary(),
        "loraplex": {k: v.summary() for k, v in lp.items() if k != "base"},
        "peft": {k: v.summary() for k, v in peft.items()},
        "table": rows_json,
        "bar": bar,
        "output_token_counts_equal": counts_ok,
        "greedy_agreement_vs_peft": agreement,
        "adapter_effect_vs_base": adapter_effect,
    }
    out = write_json(args.out, data)
    print(f"\nwrote {out}")
    if args.plot:
        make_plot(Path(args.plot), data)
        print(f"wrote {args.plot}")
    return data


def make_plot(path: Path, report: dict[str, Any]) -> None:
    """Output tok/s vs N: loraplex with N adapters, its base model, the bar and PEFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["table"]
    ns = [r["N"] for r in rows]
    base = report["loraplex_base"]["output_tok_s"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ns, [r["loraplex_tok_s"] for r in rows], "o-", color="#2b7bba", label="loraplex, N adapters")
    ax.axhline(base, color="#2b7bba", ls="--", lw=1, label=f"loraplex base model ({base:.0f})")
    ax.axhline(base * BAR_VS_BASE, color="#2b7bba", ls=":", lw=1, label=f"{BAR_VS_BASE}x base (bar)")
    peft = [(r["N"], r["peft_tok_s"]) for r in rows if r.get("peft_tok_s")]
    if peft:
        ax.plot(
            [n for n, _ in peft],
            [v for _, v in peft],
            "s-",
            color="#999999",
            label=f"PEFT adapter_names, static batches of {report['settings']['peft_batch_size']}",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_yscale("log")
    ax.set_xlabel(f"number of adapters N (power law, alpha = {report['settings']['alpha']:g})")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Multi-LoRA throughput ({report['workload']['num_requests']} requests)")
    ax.legend(fontsize=8, loc="center left")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
