"""Adapters against the same engine's base model, decode-heavy, side by side in one run (issue 45).

One process, one engine per base path, every workload on that engine first on the base model
(``lora_request=None``), then with its adapters, then on the base again; the ratio is the
LoRA run's output tok/s over the pooled base runs' (all base tokens / all base seconds), so
a load drift during the LoRA run shows as a gap between the two base runs::

    .venv/bin/python benchmarks/lora_vs_base.py                               # full run
    .venv/bin/python benchmarks/lora_vs_base.py --scale 0.25 --paths float    # quick check

Workloads (issue 45's, prompts U[32, 160] random token ids, outputs U[32, 96], EOS ignored):

* ``r16x32``: 32 random rank-16 PEFT adapters on all seven projections (q, k, v, o, gate,
  up, down), 64 requests, adapters round-robin (every step mixes all 32);
* ``r8x512`` / ``r8x1024``: 512 / 1,024 rank-8 adapters on q_proj and v_proj, one request
  per adapter (``--many-requests`` caps how many requests run: each names a distinct adapter);
* ``one``: one rank-16 all-seven adapter (adapter 0 of ``r16x32``) for all 64 requests.

Base paths (``--paths``): ``float`` is the float32 HF folder of the bundled model
(``quantization="none"``: the C graph over float panels), ``quant`` the bundled GGUF with the
engine's default quantization (``gguf``: the C graph over Q4_1 blocks). Engine defaults
otherwise, prefix caching off (the base and LoRA runs repeat the same prompts).

Adapters are made resident by an untimed warm-up (one short request per adapter) before the
timed runs: the figures are steady-state serving, not cold loads. ``--scale`` multiplies the
request counts (development runs); the docs say which scale ran.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    format_table,
    machine_info,
    random_token_workload,
    set_torch_threads,
    write_json,
)
from benchmarks.lora_runs import run_loraplex_once  # noqa: E402
from benchmarks.lora_workloads import make_adapters  # noqa: E402

ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WORKLOADS = {
    # name: (adapters, rank, target modules, requests (None: one per adapter), one adapter for all)
    "r16x32": (32, 16, ALL_SEVEN, 64, False),
    "r8x512": (512, 8, ("q_proj", "v_proj"), None, False),
    "r8x1024": (1024, 8, ("q_proj", "v_proj"), None, False),
    "one": (1, 16, ALL_SEVEN, 64, True),
}
DEFAULT_OUT = RESULTS_DIR / "lora_vs_base.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paths", default="float,quant", help="comma list of float, quant")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every workload's request count")
    p.add_argument("--many-requests", type=int, default=None, help="cap on r8x512 / r8x1024's requests")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--page-rank", type=int, default=None, help="lora_page_rank (default: the engine's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--adapter-dir", default=None, help="where the random adapters are written (reused)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--no-bracket-base", action="store_true", help="base before the LoRA run only")
    return p.parse_args(argv)


def adapters_for(root: Path, model_dir: Path, count: int, rank: int, targets: tuple[str, ...]) -> list[Path]:
    """``count`` random PEFT adapters (seeded: adapter i from seed 1234 + i), written once under
    ``root`` and reused by later runs."""
    folder = root / f"r{rank}-{'-'.join(t.split('_')[0] for t in targets)}-{count}"
    done = folder / "done.json"
    width = max(2, len(str(count - 1)))
    paths = [folder / f"adapter-{i:0{width}d}" for i in range(count)]
    if done.exists():
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    ns = argparse.Namespace(rank=rank, lora_alpha=2 * rank, target_modules=list(targets), init_std=0.02)
    ns.adapter_seed = 1234
    made = make_adapters(ns, model_dir, folder, count)
    assert [m.name for m in made] == [p.name for p in paths]
    done.write_text(json.dumps({"count": count}))
    return paths


def engine_kwargs(path: str, model_dir: Path, threads: int, page_rank: int | None = None) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "enable_lora": True,
        "enable_prefix_caching": False,
        "max_lora_rank": 16,
        "num_threads": threads,
        "seed": 0,
    }
    if page_rank is not None:
        kw["lora_page_rank"] = page_rank
    if path == "float":
        kw.update(model=str(model_dir), quantization="none")
    return kw  # quant: the bundled GGUF, quantization auto (gguf)


def run_path(
    path: str, args: argparse.Namespace, model_dir: Path, adapter_root: Path, vocab: int, special: list[int]
) -> dict[str, Any]:
    from loraplex import LLM, LoRARequest, SamplingParams

    llm = LLM(**engine_kwargs(path, model_dir, args.threads, args.page_rank))
    engine = llm.llm_engine
    graph = getattr(engine.runner.model, "_graph", None) is not None
    print(f"[{path}] C graph in use: {graph}", flush=True)
    next_id = 1
    results: dict[str, Any] = {"c_graph": graph, "workloads": {}}
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for name in args.workloads:
        count, rank, targets, requests, single = WORKLOADS[name]
        if requests is None:
            requests = count if args.many_requests is None else min(count, args.many_requests)
        requests = max(1, math.ceil(requests * args.scale))
        paths = adapters_for(adapter_root, model_dir, count, rank, targets)
        wl = random_token_workload(requests, (32, 160), (32, 96), vocab, seed=args.seed, exclude_ids=special)
        reqs = [LoRARequest(p.name + f"-{name}", next_id + i, str(p)) for i, p in enumerate(paths)]
        next_id += len(paths)
        # One adapter for all, or round-robin (one request each when requests <= adapters).
        loras = [reqs[0]] * requests if single else [reqs[i % count] for i in range(requests)]
        used = list(dict.fromkeys(loras))
        # Untimed: every adapter used made resident, kernels and code paths warmed.
        llm.generate([[100 + i % 50] * 8 for i in range(len(used))], warm, lora_request=used, use_tqdm=False)
        llm.generate(wl.prompts[:4], warm, use_tqdm=False)
        base_runs = [run_loraplex_once(llm, f"{name}/base", wl, [None] * requests, False)]
        lora_run = run_loraplex_once(llm, f"{name}/lora", wl, loras, False)
        if not args.no_bracket_base:
            base_runs.append(run_loraplex_once(llm, f"{name}/base2", wl, [None] * requests, False))
        base_tok = sum(r.output_tokens for r in base_runs)
        base_s = sum(r.seconds for r in base_runs)
        base_rate = base_tok / base_s
        lora_rate = lora_run.output_tokens / lora_run.seconds
        # Per CPU-second of this process (all threads): less moved by other processes on a
        # shared machine than wall-clock rates, which the bracket can only expose.
        base_cpu = base_tok / sum(r.cpu_seconds for r in base_runs)
        lora_cpu = lora_run.output_tokens / lora_run.cpu_seconds
        rec = {
            "adapters": count,
            "rank": rank,
            "targets": list(targets),
            "requests": requests,
            "adapters_used": len(used),
            "output_tokens": lora_run.output_tokens,
            "base_tok_s": [r.output_tokens / r.seconds for r in base_runs],
            "base_tok_s_pooled": base_rate,
            "lora_tok_s": lora_rate,
            "ratio": lora_rate / base_rate,
            "base_tok_per_cpu_s": base_cpu,
            "lora_tok_per_cpu_s": lora_cpu,
            "cpu_ratio": lora_cpu / base_cpu,
            "lora_steps": lora_run.extra["engine_steps"],
            "base_steps": base_runs[0].extra["engine_steps"],
            "workload": wl.summary() if hasattr(wl, "summary") else wl.description,
        }
        results["workloads"][name] = rec
        print(
            f"[{path}] {name}: base {', '.join(f'{v:.0f}' for v in rec['base_tok_s'])} tok/s, "
            f"lora {lora_rate:.0f} tok/s, ratio {rec['ratio']:.3f}, per CPU-s {rec['cpu_ratio']:.3f} "
            f"({requests} requests)",
            flush=True,
        )
        gc.collect()
    del llm, engine
    gc.collect()
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.paths = [p for p in args.paths.split(",") if p]
    args.workloads = [w for w in args.workloads.split(",") if w]
    for w in args.workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}")
    set_torch_threads(args.threads)
    from transformers import AutoTokenizer

    from loraplex.platform.model.source import resolve_model_dir

    model_dir = resolve_model_dir(None)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    root = Path(args.adapter_dir or Path(tempfile.gettempdir()) / "loraplex-lora-vs-base")
    report: dict[str, Any] = {
        "argv": sys.argv[1:] if argv is None else argv,
        "machine": machine_info(),
        "scale": args.scale,
        "paths": {},
    }
    for path in args.paths:
        report["paths"][path] = run_path(path, args, model_dir, root, vocab, list(tok.all_special_ids))
    rows = [
        [
            path,
            name,
            w["adapters"],
            w["requests"],
            " / ".join(f"{v:.0f}" for v in w["base_tok_s"]),
            w["lora_tok_s"],
            f"{w['ratio']:.2f}x",
            f"{w['cpu_ratio']:.2f}x",
        ]
        for path, res in report["paths"].items()
        for name, w in res["workloads"].items()
    ]
    print(
        format_table(
            ["path", "workload", "adapters", "requests", "base tok/s", "LoRA tok/s", "ratio", "per CPU-s"],
            rows,
        )
    )
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
