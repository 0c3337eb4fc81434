"""The many-adapters benchmark's checks, tables (printed and as Markdown), JSON and plot
(``many_adapters.py`` runs; this reports)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import Workload, format_table, machine_info, token_agreement, write_json
from benchmarks.lora_runs import RunResult, aligned, command_line
from benchmarks.lora_workloads import adapter_histogram

SCRIPT = "many_adapters"
BAR_VS_BASE = 0.7  # every N and mix, engine defaults: loraplex LoRA >= 0.7 x the same engine's base
GOAL_VS_BASE = 0.8


def config_label(cap: int | None) -> str:
    """An engine configuration's name: ``default`` (no max_loras) or ``max_loras=<cap>``."""
    return "default" if cap is None else f"max_loras={cap}"


@dataclass
class ManyRun:
    """One timed loraplex run of the many-adapters benchmark."""

    config: str
    n: int
    mix: str
    result: RunResult
    assign: list[int]
    base_key: int  # requests of the base workload it is compared with


def report_many(
    args: argparse.Namespace,
    argv: list[str] | None,
    wl: Workload,
    sizes: dict[int, int],
    assignments: dict[tuple[int, str], list[int]],
    configs: dict[str, dict[str, Any]],
    runs: list[ManyRun],
    bases: dict[tuple[str, int], RunResult],
    peft_check: dict[str, Any],
    size_mb: float,
    make_s: float,
) -> dict[str, Any]:
    """Checks, tables (printed and as Markdown), JSON and the plot of the many-adapters benchmark."""

    # Every run produced exactly its requests' lengths.
    def lengths_ok(res: RunResult, r: int, partial: bool) -> bool:
        wants = wl.max_tokens[:r]
        if partial:  # a time-limited run: unfinished requests are cut short
            return len(res.outputs) == r and all(len(o) <= m for o, m in zip(res.outputs, wants, strict=True))
        return [len(o) for o in res.outputs] == wants

    counts_ok = all(
        lengths_ok(m.result, m.base_key, configs[m.config]["time_limit_s"] is not None) for m in runs
    ) and all(lengths_ok(b, r, configs[c]["time_limit_s"] is not None) for (c, r), b in bases.items())
    # The same request on the same adapter gives the same greedy tokens in every configuration.
    ref_label = config_label(args.configs[0])
    by_key = {(m.config, m.n, m.mix): m for m in runs}
    agreement: dict[str, Any] = {}
    for m in runs:
        if m.config == ref_label:
            continue
        ref = by_key.get((ref_label, m.n, m.mix))
        if ref is None:
            continue
        k = min(len(ref.assign), len(m.assign))
        x, y = aligned(ref.result.outputs[:k], m.result.outputs[:k])
        agreement[f"{m.config} N={m.n} {m.mix}"] = token_agreement(x, y)
    effect: dict[str, Any] = {}
    for m in runs:
        if m.config == ref_label:
            d = token_agreement(bases[(m.config, m.base_key)].outputs, m.result.outputs)
            effect[f"N={m.n} {m.mix}"] = {"positional_same_as_base": d["positional"], "prefix": d["prefix"]}

    rows_json: list[dict[str, Any]] = []
    for m in runs:
        base = bases[(m.config, m.base_key)]
        r = m.result
        rows_json.append(
            {
                "config": m.config,
                "N": m.n,
                "mix": m.mix,
                "requests": m.base_key,
                "distinct_adapters": len(set(m.assign)),
                "loraplex_tok_s": round(r.tok_s, 2),
                "base_tok_s": round(base.tok_s, 2),
                "ratio_to_base": round(r.tok_s / base.tok_s, 3) if base.tok_s else None,
                "ratio_to_base_cpu": round(r.tok_cpu_s / base.tok_cpu_s, 3) if base.tok_cpu_s else None,
                "preemptions": r.extra.get("preemptions"),
                "engine_steps": r.extra.get("engine_steps"),
                "capped": configs[m.config]["request_limit"] is not None
                or configs[m.config]["time_limit_s"] is not None,
                "finished_requests": r.extra.get("finished_requests", m.base_key),
            }
        )
    headers = [
        "config",
        "N",
        "mix",
        "requests done",
        "adapters",
        "tok/s",
        "base tok/s",
        "/ base",
        "/ base (CPU-s)",
    ]
    table = format_table(
        headers,
        [
            [
                r["config"],
                r["N"],
                r["mix"],
                f"{r['finished_requests']}/{r['requests']}{' (capped)' if r['capped'] else ''}",
                r["distinct_adapters"],
                f"{r['loraplex_tok_s']:.1f}",
                f"{r['base_tok_s']:.1f}",
                f"{r['ratio_to_base']:.2f}x",
                f"{r['ratio_to_base_cpu']:.2f}x",
            ]
            for r in rows_json
        ],
    )
    ttft_rows = []
    for label, info in configs.items():
        s = info.get("ttft", {}).get("summary")
        if s:
            ttft_rows.append(
                [
                    label,
                    ",".join(s["tiers_before"]),
                    s["registered_unused_ms"],
                    s["loaded_ms"],
                    s["base_ms"],
                    s["first_use_ms"],
                ]
            )
    ttft_table = format_table(
        [
            "config",
            "tier before",
            "TTFT registered, never used (ms)",
            "same adapter again (ms)",
            "base model (ms)",
            "adapter never registered (ms)",
        ],
        ttft_rows,
    )
    bar_rows = [r for r in rows_json if r["config"] == ref_label and not r["capped"]]
    min_ratio: float | None = min((float(r["ratio_to_base"]) for r in bar_rows), default=None)
    bar = {
        "config": ref_label,
        "bar": BAR_VS_BASE,
        "goal": GOAL_VS_BASE,
        "min_ratio_to_base": min_ratio,
        "pass": min_ratio is not None and min_ratio >= BAR_VS_BASE,
    }
    print(f"\noutput token counts equal to the workload's: {counts_ok}")
    for name, a in agreement.items():
        print(
            f"greedy agreement {name} vs {ref_label}, on the tokens both generated: "
            f"{a['positional']:.1%} of {a['num_tokens']} tokens, {a['exact_requests']:.1%} of "
            f"{a['num_requests']} requests identical"
        )
    for name, e in effect.items():
        print(
            f"adapters vs base model, {ref_label} {name}: "
            f"{e['positional_same_as_base']:.1%} of positions the same"
        )
    print("\n" + table)
    if ttft_rows:
        print("\nTime to first token, one request alone on the idle engine:\n" + ttft_table)
    if min_ratio is not None:
        print(
            f"bar ({ref_label}, every N and mix): lowest {min_ratio:.2f}x base (>= {BAR_VS_BASE}: "
            f"{'PASS' if bar['pass'] else 'FAIL'}; goal {GOAL_VS_BASE})"
        )

    report: dict[str, Any] = {
        "benchmark": SCRIPT,  # benchmarks/many_adapters.py (it grew out of multi_lora_throughput.py)
        "command": command_line(SCRIPT, argv),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items()},
        "workload": wl.summary(),
        "requests_per_n": {str(n): r for n, r in sizes.items()},
        "adapters": {
            "count": max(sizes),
            "rank": args.rank,
            "lora_alpha": args.lora_alpha,
            "target_modules": list(args.target_modules),
            "init": f"A, B ~ N(0, {args.init_std}^2), seed {args.adapter_seed} + index",
            "size_mib_each": round(size_mb, 3),
            "make_seconds": round(make_s, 2),
        },
        "mixes": {
            f"N={n} {mix}": {
                "requests_per_adapter_used": sorted({c for c in adapter_histogram(a, n) if c}),
                "distinct_adapters": len(set(a)),
            }
            for (n, mix), a in assignments.items()
        },
        "configs": configs,
        "base": {f"{c} R={r}": b.summary() for (c, r), b in bases.items()},
        "runs": {m.result.name: m.result.summary() for m in runs},
        "table": rows_json,
        "bar": bar,
        "output_token_counts_equal": counts_ok,
        "greedy_agreement_vs_first_config": agreement,
        "adapter_effect_vs_base": effect,
        "peft_reference": peft_check,
    }
    out = write_json(args.out, report)
    md = out.with_suffix(".md")
    md.write_text(
        f"# Multi-LoRA, many adapters\n\n`{report['command']}`\n\n{report['timestamp']}, "
        f"{wl.description}\n\n{table}\n\n"
        + (
            f"Time to first token, one request alone on the idle engine:\n\n{ttft_table}\n"
            if ttft_rows
            else ""
        )
    )
    print(f"\nwrote {out} and {md}")
    if args.plot:
        make_many_plot(Path(args.plot), report)
        print(f"wrote {args.plot}")
    return report


def make_many_plot(path: Path, report: dict[str, Any]) -> None:
    """Throughput relative to the same engine's base model vs N, one line per config and mix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["table"]
    colors = ["#2b7bba", "#d95f02", "#7570b3", "#1b9e77", "#e7298a", "#666666"]
    styles = {"uniform": ("o", "-"), "powerlaw": ("s", "--")}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, label in enumerate(dict.fromkeys(r["config"] for r in rows)):
        for mix, (marker, ls) in styles.items():
            pts = sorted(
                (r["N"], r["ratio_to_base"], r["capped"])
                for r in rows
                if r["config"] == label and r["mix"] == mix
            )
            if not pts:
                continue
            capped = " (capped runs)" if pts[0][2] else ""
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker=marker,
                ls=ls,
                color=colors[i % len(colors)],
                label=f"{label}, {mix}{capped}",
            )
    ax.axhline(1.0, color="#999999", lw=1)
    ax.axhline(BAR_VS_BASE, color="#999999", ls=":", lw=1, label=f"{BAR_VS_BASE}x base (bar)")
    ns = sorted({r["N"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_ylim(0, max(1.1, max((r["ratio_to_base"] for r in rows), default=1.0) * 1.05))
    ax.set_xlabel(
        f"distinct adapters N (r = {report['adapters']['rank']}, "
        f"{'+'.join(report['adapters']['target_modules'])})"
    )
    ax.set_ylabel("output tok/s / same engine's base model")
    ax.set_title("Multi-LoRA throughput with many adapters")
    # beside the axes: inside, it hides the low capped points whatever corner it takes
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
