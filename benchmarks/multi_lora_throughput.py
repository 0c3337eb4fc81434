"""Multi-LoRA throughput: loraplex with N adapters vs its own base model vs PEFT mixed batches.

One process, one seeded workload (the engine benchmark's: random token prompts,
lengths uniform, EOS ignored), one loraplex engine for every run::

    .venv/bin/python benchmarks/multi_lora_throughput.py                       # full run
    .venv/bin/python benchmarks/multi_lora_throughput.py --num-requests 16 --max-prompt 64 \\
        --max-output 32 --adapters 1,4 --peft-requests 8                       # quick check

Adapters: ``max(--adapters)`` PEFT LoRA adapters of rank ``--rank`` (16) on all seven
projections of every layer (q, k, v, o, gate, up, down: the heavy case), random
non-zero A and B (seeded), written with ``save_pretrained`` to a temporary folder
(or ``--adapter-dir``). The run with N adapters uses adapters 0 .. N-1.

Popularity (S-LoRA's synthetic trace, ``benchmarks/trace.py`` of S-LoRA): request j
draws ``x_j ~ Power(alpha)`` (numpy's ``power``: density ``alpha * x^(alpha-1)`` on
[0, 1]) and uses adapter ``floor(x_j * N)``, so

    P(adapter i) = ((i + 1) / N)^alpha - (i / N)^alpha,   i = 0 .. N-1

(alpha = 0.3: adapter 0 takes 35% of the requests at N = 32, the tail is long). The
same ``x_j`` serve every N, so the runs differ only in how finely they are split.
``--popularity zipf`` uses ``P(i) ∝ (i + 1)^-alpha`` instead.

Systems:

* loraplex base: the same engine (same arguments, LoRA enabled) with every request on
  the base model (``lora_request=None``). It runs before the LoRA runs and again after
  them (``--no-bracket-base``: before only); the ratios use the pooled figure (all base
  output tokens / all base seconds), so a load drift on a shared machine during the
  LoRA runs shows up as a gap between the two base runs instead of a skewed ratio.
* loraplex, N adapters: the whole workload submitted at once, one ``LoRARequest`` per
  request. Adapters are registered and made resident by an untimed warm-up (one tiny
  request per adapter) before the timed runs: the figures are steady-state serving,
  not cold loads (the warm-up time is reported separately).
* PEFT: ``PeftModel`` with all adapters loaded, ``generate(..., adapter_names=[...])``
  (PEFT's mixed-adapter batch inference) on static batches of ``--peft-batch-size``
  (16), left-padded, greedy, EOS disabled; each batch decodes to the largest
  ``max_tokens`` in it and only each request's own ``max_tokens`` count. PEFT is slow
  on a CPU, so it runs on the first ``--peft-requests`` requests of the workload; the
  script prints that subset's mean lengths next to the full workload's.

Throughput is output tokens per wall-clock second; output tokens per CPU-second
(process CPU time, all threads) is reported too, as it is less disturbed by other
processes on a shared machine.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    Workload,
    format_table,
    generate_left_padded,
    machine_info,
    random_token_workload,
    set_torch_threads,
    stopwatch,
    token_agreement,
    write_json,
)

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BAR_VS_BASE = 0.7  # at the largest N: loraplex LoRA >= 0.7 x loraplex base
BAR_VS_PEFT = 4.0  # at the largest N: loraplex LoRA >= 4 x PEFT
BAR_N = 32
DEFAULT_OUT = RESULTS_DIR / "multi_lora_throughput.json"


@dataclass
class RunResult:
    name: str
    seconds: float
    cpu_seconds: float
    output_tokens: int  # useful tokens: each request's own max_tokens
    outputs: list[list[int]] = field(repr=False)
    generated_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tok_cpu_s(self) -> float:
        return self.output_tokens / self.cpu_seconds if self.cpu_seconds > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 3),
            "cpu_seconds": round(self.cpu_seconds, 2),
            "output_tokens": self.output_tokens,
            "generated_tokens": self.generated_tokens,
            "output_tok_s": round(self.tok_s, 2),
            "output_tok_per_cpu_s": round(self.tok_cpu_s, 2),
            "num_requests": len(self.outputs),
            **self.extra,
        }


# -- arguments -----------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    vals = sorted({int(v) for v in text.split(",") if v.strip()})
    if not vals or vals[0] < 1:
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return vals


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--model", default=None, help="HF model directory (default: the bundled SmolLM2-135M-Instruct)"
    )
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="workload seed (prompts, lengths)")
    p.add_argument("--adapters", type=_int_list, default=[1, 4, 16, 32], help="comma list of N")
    p.add_argument("--alpha", type=float, default=0.3, help="power-law exponent of adapter popularity")
    p.add_argument(
        "--popularity",
        choices=["slora", "zipf"],
        default="slora",
        help="slora: adapter floor(N * x), x ~ Power(alpha) (S-LoRA's trace); zipf: P(i) ∝ (i+1)^-alpha",
    )
    p.add_argument("--popularity-seed", type=int, default=42, help="seed of the adapter draw (S-LoRA: 42)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32, help="PEFT lora_alpha (scale = lora_alpha / rank)")
    p.add_argument("--init-std", type=float, default=0.02, help="std of the random A and B entries")
    p.add_argument("--adapter-seed", type=int, default=1234)
    p.add_argument(
        "--adapter-dir",
        default=None,
        help="where to write the adapters (kept); default: a temporary folder, removed at the end",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads for every system")
    # loraplex engine
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="as the engine benchmark")
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--max-loras", type=int, default=None, help="adapter slots (default: the largest N)")
    p.add_argument("--lora-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "cpu"],
        help="attention kernels on the CPU (auto: the C decode kernel when it builds)",
    )
    p.add_argument(
        "--linear-backend",
        default="auto",
        choices=["auto", "torch", "cpu"],
        help="loraplex dense projections on the CPU (auto: the C packed-panel kernel when it builds)",
    )
    # PEFT
    p.add_argument("--peft-requests", type=int, default=32, help="PEFT runs on the first K requests")
    p.add_argument("--peft-batch-size", type=int, default=16)
    p.add_argument("--skip-peft", action="store_true")
    p.add_argument(
        "--no-bracket-base", action="store_true", help="run the base model once (before), not before+after"
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-ups")
    p.add_argument("--profile", default=None, help="cProfile the loraplex run at the largest N into PATH")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results path")
    p.add_argument("--plot", default=None, help="PNG path: output tok/s vs N")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    args = p.parse_args(argv)
    if args.max_loras is None:
        args.max_loras = max(args.adapters)
    args.peft_requests = max(0, min(args.peft_requests, args.num_requests))
    return args


# -- workload ------------------------------------------------------------------------------
def build_workload(args: argparse.Namespace, model_dir: Path) -> Workload:
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return random_token_workload(
        args.num_requests,
        (args.min_prompt, args.max_prompt),
        (args.min_output, args.max_output),
        vocab,
        seed=args.seed,
        exclude_ids=tok.all_special_ids,
    )


def popularity_probs(n: int, alpha: float, kind: str) -> list[float]:
    """Exact probability of each adapter index under the sampler ``assign_adapters`` uses."""
    if kind == "slora":
        return [((i + 1) / n) ** alpha - (i / n) ** alpha for i in range(n)]
    w = [(i + 1) ** -alpha for i in range(n)]
    return [v / sum(w) for v in w]


def assign_adapters(num_requests: int, n: int, alpha: float, kind: str, seed: int) -> list[int]:
    """Adapter index (0 .. n-1) of each request.

    ``slora`` is S-LoRA's ``generate_requests``: ``x = np.random.power(alpha, num)``,
    ``index = (x * n).astype(int)``; the same ``x`` for every ``n`` (fixed seed).
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    if kind == "slora":
        x = rng.power(alpha, num_requests)
        return [min(int(v), n - 1) for v in (x * n).astype(int)]
    u = rng.random(num_requests)
    cdf = np.cumsum(popularity_probs(n, alpha, kind))
    return [min(int(v), n - 1) for v in np.searchsorted(cdf, u, side="right")]


def adapter_histogram(assign: list[int], n: int) -> list[int]:
    counts = [0] * n
    for a in assign:
        counts[a] += 1
    return counts


# -- adapters ------------------------------------------------------------------------------
def make_adapters(args: argparse.Namespace, model_dir: Path, root: Path, count: int) -> list[Path]:
    """``count`` rank-``args.rank`` PEFT adapters on all seven projections, random A and B."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=args.rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules=list(TARGET_MODULES)
    )
    model = get_peft_model(base, cfg)
    params = [(n, p) for n, p in model.named_parameters() if "lora_A" in n or "lora_B" in n]
    paths = []
    for i in range(count):
        gen = torch.Generator().manual_seed(args.adapter_seed + i)
        with torch.no_grad():
            for _, p in params:
                p.copy_(torch.randn(p.shape, generator=gen) * args.init_std)
        path = root / f"adapter-{i:02d}"
        model.save_pretrained(path)
        paths.append(path)
    del model, base
    gc.collect()
    return paths


# -- loraplex ------------------------------------------------------------------------------
def engine_args(args: argparse.Namespace, num_adapters: int) -> dict[str, Any]:
    return {
        "dtype": args.dtype,
        "enable_lora": True,
        "max_loras": args.max_loras,
        "max_cpu_loras": max(args.max_loras, num_adapters),
        "max_lora_rank": args.rank,
        "lora_backend": args.lora_backend,
        "attention_backend": args.attention_backend,
        "linear_backend": args.linear_backend,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory": int(args.kv_cache_gib * 2**30),
        "num_threads": args.threads,
        "seed": 0,
    }


def run_loraplex_once(
    llm: Any, name: str, wl: Workload, loras: list[Any], progress: bool, profile: str | None = None
) -> RunResult:
    from loraplex import SamplingParams

    engine = llm.llm_engine
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
    steps0, pre0 = engine.num_steps, engine.scheduler.num_preemptions
    gc.collect()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    with stopwatch() as t:
        outs = llm.generate(wl.prompts, params, lora_request=loras, use_tqdm=progress)
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    return RunResult(
        name,
        t["seconds"],
        t["cpu_seconds"],
        output_tokens=sum(len(o) for o in outputs),
        outputs=outputs,
        generated_tokens=sum(len(o) for o in outputs),
        extra={
            "engine_steps": engine.num_steps - steps0,
            "preemptions": engine.scheduler.num_preemptions - pre0,
        },
    )


# -- PEFT ----------------------------------------------------------------------------------
def load_peft(model_dir: Path, paths: list[Path], dtype: str) -> Any:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    td = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=td, attn_implementation="sdpa")
    model = PeftModel.from_pretrained(base, str(paths[0]), adapter_name=paths[0].name)
    for path in paths[1:]:
        model.load_adapter(str(path), adapter_name=path.name)
    model.eval()
    model.base_model.model.generation_config.eos_token_id = None  # EOS ignored
    return model


def _peft_batch(
    model: Any, prompts: list[list[int]], names: list[str], max_new: int, pad_id: int
) -> list[list[int]]:
    """PEFT's mixed-adapter batch: one static left-padded batch, adapter ``names[i]`` per row."""
    return generate_left_padded(model, prompts, max_new, pad_id, adapter_names=names)


def run_peft(
    model: Any, name: str, wl: Workload, names: list[str], batch_size: int, progress: bool
) -> RunResult:
    from tqdm.auto import tqdm

    pid = model.base_model.model.config.pad_token_id
    pad = int(pid) if pid is not None else 0
    outputs: list[list[int]] = []
    generated = useful = 0
    bar = tqdm(total=len(wl), desc=name, unit="req", disable=not progress)
    gc.collect()
    with stopwatch() as t:
        for lo in range(0, len(wl), batch_size):
            prompts = wl.prompts[lo : lo + batch_size]
            wants = wl.max_tokens[lo : lo + batch_size]
            rows = _peft_batch(model, prompts, names[lo : lo + batch_size], max(wants), pad)
            generated += sum(len(r) for r in rows)
            for row, m in zip(rows, wants, strict=True):
                if len(row) < m:
                    raise RuntimeError(f"PEFT produced {len(row)} tokens for a request wanting {m}")
                outputs.append(row[:m])
            useful += sum(wants)
            bar.update(len(prompts))
            elapsed = bar.format_dict.get("elapsed") or 0.0
            if elapsed:
                bar.set_postfix(out_tok_s=f"{useful / elapsed:.1f}")
    bar.close()
    return RunResult(
        name,
        t["seconds"],
        t["cpu_seconds"],
        output_tokens=sum(len(o) for o in outputs),
        outputs=outputs,
        generated_tokens=generated,
        extra={"wasted_output_tokens": generated - useful, "batch_size": batch_size},
    )


# -- reporting -----------------------------------------------------------------------------
def make_plot(path: Path, report: dict[str, Any]) -> None:
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


def pool_runs(name: str, runs: list[RunResult]) -> RunResult:
    """Several runs of the same workload as one: tokens and seconds summed (outputs of the first)."""
    if len(runs) == 1:
        return runs[0]
    return RunResult(
        name,
        sum(r.seconds for r in runs),
        sum(r.cpu_seconds for r in runs),
        output_tokens=sum(r.output_tokens for r in runs),
        outputs=runs[0].outputs,
        generated_tokens=sum(r.generated_tokens for r in runs),
        extra={
            "pooled_runs": [
                {"seconds": round(r.seconds, 3), "output_tok_s": round(r.tok_s, 2), **r.extra} for r in runs
            ]
        },
    )


def checkpoint(path: str, argv: list[str] | None, runs: dict[str, RunResult]) -> None:
    """Write the runs finished so far (``"partial": true``): a killed run still leaves its figures."""
    write_json(
        path,
        {
            "benchmark": "multi_lora_throughput",
            "partial": True,
            "command": " ".join(
                ["benchmarks/multi_lora_throughput.py", *(argv if argv is not None else sys.argv[1:])]
            ),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine_info(),
            "runs": {k: r.summary() for k, r in runs.items()},
        },
    )


def _subset(wl: Workload, k: int) -> Workload:
    return Workload(
        prompts=wl.prompts[:k],
        max_tokens=wl.max_tokens[:k],
        seed=wl.seed,
        description=f"first {k} requests of: {wl.description}",
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    from loraplex import LLM, LoRARequest, SamplingParams
    from loraplex.platform.model.source import resolve_model_dir

    progress = not args.no_progress
    threads = set_torch_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    wl = build_workload(args, model_dir)
    n_max = max(args.adapters)
    print(f"workload: {wl.description}", flush=True)
    print(
        f"  prompt tokens {wl.num_prompt_tokens}, output tokens {wl.num_output_tokens}; dtype {args.dtype}, "
        f"torch threads {threads}",
        flush=True,
    )
    sub = _subset(wl, args.peft_requests)
    if args.peft_requests and not args.skip_peft:
        fs, ss = wl.summary(), sub.summary()
        print(
            f"  PEFT subset: first {len(sub)} requests: mean prompt {ss['prompt_tokens']['mean']:.1f} "
            f"(full {fs['prompt_tokens']['mean']:.1f}), mean output {ss['output_tokens']['mean']:.1f} "
            f"(full {fs['output_tokens']['mean']:.1f})",
            flush=True,
        )

    assignments = {
        n: assign_adapters(len(wl), n, args.alpha, args.popularity, args.popularity_seed)
        for n in args.adapters
    }
    for n in args.adapters:
        hist = adapter_histogram(assignments[n], n)
        print(
            f"  N={n}: requests per adapter {hist} (P(adapter 0) = "
            f"{popularity_probs(n, args.alpha, args.popularity)[0]:.3f})",
            flush=True,
        )

    tmp_root = None
    if args.adapter_dir:
        adapter_root = Path(args.adapter_dir)
        adapter_root.mkdir(parents=True, exist_ok=True)
    else:
        tmp_root = Path(tempfile.mkdtemp(prefix="loraplex-multilora-"))
        adapter_root = tmp_root
    try:
        with stopwatch() as t_make:
            paths = make_adapters(args, model_dir, adapter_root, n_max)
        size_mb = sum(f.stat().st_size for f in paths[0].iterdir()) / 2**20
        print(
            f"\nmade {n_max} adapters (rank {args.rank}, lora_alpha {args.lora_alpha}, "
            f"{', '.join(TARGET_MODULES)}; {size_mb:.1f} MiB each) in {t_make['seconds']:.1f} s "
            f"under {adapter_root}",
            flush=True,
        )
        loras = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(paths)]

        # ---- loraplex: one engine for the base run and every N --------------------------
        eargs = engine_args(args, n_max)
        print(f"\n== loraplex (engine args {eargs}) ==", flush=True)
        torch.manual_seed(0)
        llm = LLM(model=args.model, **eargs)
        # What "auto" resolved to (the C kernels on a CPU with a compiler, else torch).
        eargs["resolved_backends"] = {
            "attention": llm.llm_engine.runner.attn.name,
            "linear": llm.llm_engine.model.linear.name,
            "lora": llm.llm_engine.lora_manager.backend.name,
        }
        print(f"backends: {eargs['resolved_backends']}", flush=True)
        warm_s = 0.0
        if not args.no_warmup:
            with stopwatch() as t_warm:
                for lo in loras:
                    llm.add_lora(lo)
                llm.generate(
                    [[100 + i for i in range(16)]] * (n_max + 1),
                    SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                    lora_request=[None, *loras],
                    use_tqdm=False,
                )
            warm_s = t_warm["seconds"]
            print(f"warm-up (register + load {n_max} adapters, 1 tiny request each): {warm_s:.1f} s")

        lp: dict[str, RunResult] = {}
        base = run_loraplex_once(llm, "loraplex base", wl, [None] * len(wl), progress)
        base_runs = [base]
        done: dict[str, RunResult] = {"loraplex base": base}
        checkpoint(args.out, argv, done)
        print(f"loraplex base: {base.output_tokens} tok in {base.seconds:.1f} s = {base.tok_s:.1f} tok/s")
        for n in args.adapters:
            reqs = [loras[a] for a in assignments[n]]
            prof = args.profile if (args.profile and n == n_max) else None
            res = run_loraplex_once(llm, f"loraplex N={n}", wl, reqs, progress, profile=prof)
            lp[str(n)] = res
            done[res.name] = res
            checkpoint(args.out, argv, done)
            print(
                f"loraplex N={n}: {res.output_tokens} tok in {res.seconds:.1f} s = {res.tok_s:.1f} tok/s "
                f"({res.tok_s / base.tok_s:.2f}x base)",
                flush=True,
            )
        if not args.no_bracket_base:
            again = run_loraplex_once(llm, "loraplex base (after)", wl, [None] * len(wl), progress)
            base_runs.append(again)
            done[again.name] = again
            checkpoint(args.out, argv, done)
            same = again.outputs == base.outputs
            print(
                f"loraplex base (after): {again.output_tokens} tok in {again.seconds:.1f} s = "
                f"{again.tok_s:.1f} tok/s (before: {base.tok_s:.1f}; outputs identical: {same})",
                flush=True,
            )
            base = pool_runs("loraplex base", base_runs)
            print(f"loraplex base, both runs pooled: {base.tok_s:.1f} tok/s", flush=True)
        lp["base"] = base
        del llm
        gc.collect()

        # ---- PEFT ------------------------------------------------------------------------
        peft: dict[str, RunResult] = {}
        peft_load_s = 0.0
        if args.peft_requests and not args.skip_peft:
            print(f"\n== PEFT (first {len(sub)} requests, static batches of {args.peft_batch_size}) ==")
            torch.manual_seed(0)
            with stopwatch() as t_load:
                model = load_peft(model_dir, paths, args.dtype)
            peft_load_s = t_load["seconds"]
            if not args.no_warmup:
                _peft_batch(model, [[100 + i for i in range(16)]] * 2, [paths[0].name, paths[-1].name], 2, 0)
            for n in args.adapters:
                names = [paths[a].name for a in assignments[n][: len(sub)]]
                res = run_peft(model, f"PEFT N={n}", sub, names, args.peft_batch_size, progress)
                peft[str(n)] = res
                done[res.name] = res
                checkpoint(args.out, argv, done)
                print(
                    f"PEFT N={n}: {res.output_tokens} tok in {res.seconds:.1f} s = {res.tok_s:.2f} tok/s "
                    f"({len({*names})} distinct adapters in the subset)",
                    flush=True,
                )
            del model
            gc.collect()
    finally:
        if tmp_root is not None:
            shutil.rmtree(tmp_root, ignore_errors=True)

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
    bar: dict[str, Any] = {}
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

    report: dict[str, Any] = {
        "benchmark": "multi_lora_throughput",
        "command": " ".join(
            ["benchmarks/multi_lora_throughput.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "settings": vars(args),
        "workload": wl.summary(),
        "peft_subset": sub.summary() if peft else None,
        "adapters": {
            "count": n_max,
            "rank": args.rank,
            "lora_alpha": args.lora_alpha,
            "target_modules": list(TARGET_MODULES),
            "init": f"A, B ~ N(0, {args.init_std}^2), seed {args.adapter_seed} + index",
            "size_mib_each": round(size_mb, 2),
            "make_seconds": round(t_make["seconds"], 2),
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
    out = write_json(args.out, report)
    print(f"\nwrote {out}")
    if args.plot:
        make_plot(Path(args.plot), report)
        print(f"wrote {args.plot}")
    return report


if __name__ == "__main__":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGTERM, chain=True)  # a killed run says where it was
    main()
