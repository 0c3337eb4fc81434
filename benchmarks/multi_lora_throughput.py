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
draws ``x_j ~ Power(alpha)`` and uses adapter ``floor(x_j * N)``, so
``P(adapter i) = ((i + 1) / N)^alpha - (i / N)^alpha`` (alpha = 0.3: adapter 0 takes 35% of
the requests at N = 32, the tail is long); the same ``x_j`` serve every N, so the runs differ
only in how finely they are split. ``--popularity zipf`` uses ``P(i) ∝ (i + 1)^-alpha``
instead (``lora_workloads.py``).

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

Hundreds to thousands of distinct adapters (issue 29) are ``many_adapters.py``'s.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    Workload,
    set_torch_threads,
    stopwatch,
)
from benchmarks.lora_runs import (  # noqa: E402
    RunResult,
    checkpoint,
    load_peft,
    peft_batch,
    pool_runs,
    resolved_backends,
    run_loraplex_once,
    run_peft,
)
from benchmarks.lora_workloads import (  # noqa: E402
    adapter_folder,
    adapter_histogram,
    adapter_size_mib,
    add_shared_args,
    assign_adapters,
    build_workload,
    finish_shared_args,
    int_list,
    make_adapters,
    popularity_probs,
    subset,
)
from benchmarks.multi_lora_report import report  # noqa: E402

SCRIPT = "multi_lora_throughput"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_OUT = RESULTS_DIR / "multi_lora_throughput.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    add_shared_args(
        p,
        num_requests=128,
        num_requests_help="requests (default 128)",
        rank=16,
        target_modules=TARGET_MODULES,
        target_modules_help="comma list (default: all seven projections)",
        max_num_batched_tokens=1024,
        kv_cache_gib=2.0,
        out=DEFAULT_OUT,
        plot_help="PNG path: output tok/s vs N",
    )
    p.add_argument("--adapters", type=int_list, default=[1, 4, 16, 32], help="comma list of N")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-loras", type=int, default=None, help="adapter slots (default: the largest N)")
    p.add_argument("--peft-requests", type=int, default=32, help="PEFT runs on the first K requests")
    p.add_argument("--profile", default=None, help="cProfile the loraplex run at the largest N into PATH")
    if any(a.split("=")[0] == "--many-adapters" for a in (argv if argv is not None else sys.argv[1:])):
        p.error("the many-adapters mode is its own script now: benchmarks/many_adapters.py")
    args = p.parse_args(argv)
    finish_shared_args(args)
    if args.max_loras is None:
        args.max_loras = max(args.adapters)
    args.peft_requests = max(0, min(args.peft_requests, args.num_requests))
    return args


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


# -- the runs --------------------------------------------------------------------------------
def run_loraplex(
    args: argparse.Namespace,
    argv: list[str] | None,
    wl: Workload,
    loras: list[Any],
    assignments: dict[int, list[int]],
    done: dict[str, RunResult],
) -> tuple[dict[str, RunResult], dict[str, Any], float]:
    """One engine: the base model, every N, the base model again. Returns the runs by N (and
    ``base``: the pooled base runs), the engine arguments and the warm-up seconds."""
    import torch

    from loraplex import LLM, SamplingParams

    progress = not args.no_progress
    n_max = max(args.adapters)
    eargs = engine_args(args, n_max)
    print(f"\n== loraplex (engine args {eargs}) ==", flush=True)
    torch.manual_seed(0)
    llm = LLM(model=args.model, **eargs)
    eargs["resolved_backends"] = resolved_backends(llm.llm_engine)
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
    done["loraplex base"] = base
    checkpoint(args.out, SCRIPT, argv, done)
    print(f"loraplex base: {base.output_tokens} tok in {base.seconds:.1f} s = {base.tok_s:.1f} tok/s")
    for n in args.adapters:
        reqs = [loras[a] for a in assignments[n]]
        prof = args.profile if (args.profile and n == n_max) else None
        res = run_loraplex_once(llm, f"loraplex N={n}", wl, reqs, progress, profile=prof)
        lp[str(n)] = res
        done[res.name] = res
        checkpoint(args.out, SCRIPT, argv, done)
        print(
            f"loraplex N={n}: {res.output_tokens} tok in {res.seconds:.1f} s = {res.tok_s:.1f} tok/s "
            f"({res.tok_s / base.tok_s:.2f}x base)",
            flush=True,
        )
    if not args.no_bracket_base:
        again = run_loraplex_once(llm, "loraplex base (after)", wl, [None] * len(wl), progress)
        base_runs.append(again)
        done[again.name] = again
        checkpoint(args.out, SCRIPT, argv, done)
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
    return lp, eargs, warm_s


def run_peft_side(
    args: argparse.Namespace,
    argv: list[str] | None,
    model_dir: Path,
    sub: Workload,
    paths: list[Path],
    assignments: dict[int, list[int]],
    done: dict[str, RunResult],
) -> tuple[dict[str, RunResult], float]:
    """PEFT on the first ``--peft-requests`` requests, every N; with its load seconds."""
    import torch

    print(f"\n== PEFT (first {len(sub)} requests, static batches of {args.peft_batch_size}) ==")
    torch.manual_seed(0)
    with stopwatch() as t_load:
        model = load_peft(model_dir, paths, args.dtype)
    if not args.no_warmup:
        peft_batch(model, [[100 + i for i in range(16)]] * 2, [paths[0].name, paths[-1].name], 2, 0)
    peft: dict[str, RunResult] = {}
    for n in args.adapters:
        names = [paths[a].name for a in assignments[n][: len(sub)]]
        res = run_peft(model, f"PEFT N={n}", sub, names, args.peft_batch_size, not args.no_progress)
        peft[str(n)] = res
        done[res.name] = res
        checkpoint(args.out, SCRIPT, argv, done)
        print(
            f"PEFT N={n}: {res.output_tokens} tok in {res.seconds:.1f} s = {res.tok_s:.2f} tok/s "
            f"({len({*names})} distinct adapters in the subset)",
            flush=True,
        )
    del model
    gc.collect()
    return peft, t_load["seconds"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from loraplex import LoRARequest
    from loraplex.platform.model.source import resolve_model_dir

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
    sub = subset(wl, args.peft_requests)
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

    done: dict[str, RunResult] = {}
    with adapter_folder(args.adapter_dir, "loraplex-multilora-") as adapter_root:
        with stopwatch() as t_make:
            paths = make_adapters(args, model_dir, adapter_root, n_max)
        size_mb = adapter_size_mib(paths[0])
        print(
            f"\nmade {n_max} adapters (rank {args.rank}, lora_alpha {args.lora_alpha}, "
            f"{', '.join(args.target_modules)}; {size_mb:.1f} MiB each) in {t_make['seconds']:.1f} s "
            f"under {adapter_root}",
            flush=True,
        )
        loras = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(paths)]
        lp, eargs, warm_s = run_loraplex(args, argv, wl, loras, assignments, done)
        peft: dict[str, RunResult] = {}
        peft_load_s = 0.0
        if args.peft_requests and not args.skip_peft:
            peft, peft_load_s = run_peft_side(args, argv, model_dir, sub, paths, assignments, done)

    return report(
        args,
        argv,
        wl,
        sub,
        assignments,
        lp,
        peft,
        eargs,
        warm_s=warm_s,
        peft_load_s=peft_load_s,
        size_mb=size_mb,
        make_s=t_make["seconds"],
    )


if __name__ == "__main__":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGTERM, chain=True)  # a killed run says where it was
    main()
