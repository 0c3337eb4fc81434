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
import math
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
DEFAULT_MANY_OUT = RESULTS_DIR / "multi_lora_many.json"
MANY_TARGET_MODULES = ("q_proj", "v_proj")
MANY_RANK = 8


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
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests (default 128; many-adapters mode: --requests-per-adapter x N for each N)",
    )
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
    p.add_argument(
        "--rank", type=int, default=None, help=f"adapter rank (default 16; many-adapters mode {MANY_RANK})"
    )
    p.add_argument(
        "--lora-alpha",
        type=int,
        default=None,
        help="PEFT lora_alpha (scale = lora_alpha / rank; default 2 x rank)",
    )
    p.add_argument(
        "--target-modules",
        default=None,
        help="comma list (default: all seven projections; many-adapters mode: q_proj,v_proj)",
    )
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
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="1024 as the engine benchmark (many-adapters mode: the engine's default)",
    )
    p.add_argument(
        "--kv-cache-gib", type=float, default=None, help="2.0 (many-adapters mode: the engine's default)"
    )
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
    p.add_argument(
        "--out",
        default=None,
        help=f"JSON results path (default {DEFAULT_OUT}; many-adapters mode {DEFAULT_MANY_OUT})",
    )
    p.add_argument("--plot", default=None, help="PNG path: output tok/s vs N")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    add_many_adapter_args(p)
    args = p.parse_args(argv)
    many = bool(args.many_adapters)
    if args.rank is None:
        args.rank = MANY_RANK if many else 16
    if args.lora_alpha is None:
        args.lora_alpha = 2 * args.rank
    args.target_modules = (
        [m for m in args.target_modules.split(",") if m]
        if args.target_modules
        else list(MANY_TARGET_MODULES if many else TARGET_MODULES)
    )
    if args.out is None:
        args.out = str(DEFAULT_MANY_OUT if many else DEFAULT_OUT)
    if many:
        if args.max_loras is not None:
            p.error("--max-loras is the classic mode's; the many-adapters mode takes caps in --configs")
        return args
    if args.num_requests is None:
        args.num_requests = 128
    if args.kv_cache_gib is None:
        args.kv_cache_gib = 2.0
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = 1024
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
    """``count`` rank-``args.rank`` PEFT adapters on ``args.target_modules``, random A and B
    (adapter i from seed ``args.adapter_seed + i``)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=args.rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules=list(args.target_modules)
    )
    model = get_peft_model(base, cfg)
    params = [(n, p) for n, p in model.named_parameters() if "lora_A" in n or "lora_B" in n]
    paths = []
    width = max(2, len(str(count - 1)))
    for i in range(count):
        gen = torch.Generator().manual_seed(args.adapter_seed + i)
        with torch.no_grad():
            for _, p in params:
                p.copy_(torch.randn(p.shape, generator=gen) * args.init_std)
        path = root / f"adapter-{i:0{width}d}"
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


# -- many-adapters mode (issue 29) ---------------------------------------------------------
MIXES = ("uniform", "powerlaw")


def _config_list(text: str) -> list[int | None]:
    """``default`` (no max_loras: the engine's default) or an integer cap, comma separated."""
    out: list[int | None] = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        if item == "default":
            out.append(None)
        elif item.isdigit() and int(item) >= 1:
            out.append(int(item))
        else:
            raise argparse.ArgumentTypeError(f"a config is 'default' or a max_loras cap >= 1, got {item!r}")
    if not out or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"need distinct configs, got {text!r}")
    return out


def _mix_list(text: str) -> list[str]:
    mixes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in mixes if m not in MIXES]
    if not mixes or bad:
        raise argparse.ArgumentTypeError(f"mixes are {', '.join(MIXES)}; got {text!r}")
    return mixes


def add_many_adapter_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("many-adapters mode (issue 29: hundreds to thousands of distinct adapters)")
    g.add_argument(
        "--many-adapters",
        type=_int_list,
        default=None,
        help="comma list of N (e.g. 256,1024): run the many-adapters mode with N distinct adapters",
    )
    g.add_argument(
        "--configs",
        type=_config_list,
        default=[None, 4, 32],
        help="engine configurations: 'default' (max_loras not passed) or a max_loras cap "
        "(default: default,4,32)",
    )
    g.add_argument(
        "--mixes",
        type=_mix_list,
        default=list(MIXES),
        help="uniform: every adapter gets 1 or 2 requests; powerlaw: --popularity/--alpha over N",
    )
    g.add_argument(
        "--requests-per-adapter",
        type=float,
        default=1.5,
        help="requests per N when --num-requests is not given (1.5: half the adapters get 2)",
    )
    g.add_argument(
        "--capped-requests",
        type=int,
        default=256,
        help="configurations with a max_loras cap below the largest N run the first K requests of "
        "each workload only (their base runs too): they are slow; 0: all",
    )
    g.add_argument("--ttft-probes", type=int, default=3, help="store-only adapters whose TTFT is measured")
    g.add_argument("--ttft-prompt", type=int, default=128, help="prompt tokens of the TTFT request")
    g.add_argument(
        "--many-peft-requests",
        type=int,
        default=8,
        help="PEFT reference on the first K requests at the largest N (0 or --skip-peft: none)",
    )
    g.add_argument(
        "--max-lora-rank", type=int, default=None, help="pass max_lora_rank (default: the engine's)"
    )
    g.add_argument(
        "--max-cpu-loras", type=int, default=None, help="pass max_cpu_loras (default: the engine's)"
    )


def config_label(cap: int | None) -> str:
    return "default" if cap is None else f"max_loras={cap}"


def many_engine_args(args: argparse.Namespace, cap: int | None) -> dict[str, Any]:
    """The engine's defaults with LoRA on and prefix caching off; ``max_loras`` only for a cap.

    Prefix caching is off because the same prompts run several times on one engine (base before
    and after, every mix): cached prompt blocks would make the later runs look faster.
    """
    ea: dict[str, Any] = {
        "dtype": args.dtype,
        "enable_lora": True,
        "enable_prefix_caching": False,
        "num_threads": args.threads,
        "seed": 0,
    }
    if cap is not None:
        ea["max_loras"] = cap
    optional = {
        "max_lora_rank": args.max_lora_rank,
        "max_cpu_loras": args.max_cpu_loras,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory": None if args.kv_cache_gib is None else int(args.kv_cache_gib * 2**30),
    }
    ea.update({k: v for k, v in optional.items() if v is not None})
    for name in ("lora_backend", "attention_backend", "linear_backend"):
        if getattr(args, name) != "auto":
            ea[name] = getattr(args, name)
    return ea


def uniform_assignment(num_requests: int, n: int, seed: int) -> list[int]:
    """Adapter of each request when every adapter is about equally popular: a random order of the
    N adapters, repeated to cover the requests, shuffled (R in [N, 2N]: each adapter gets 1 or 2
    requests; R < N: R distinct adapters)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    reps = -(-num_requests // n)
    order = np.concatenate([rng.permutation(n) for _ in range(reps)])[:num_requests]
    rng.shuffle(order)
    return [int(v) for v in order]


def many_requests(args: argparse.Namespace, n: int) -> int:
    return args.num_requests or max(1, math.ceil(args.requests_per_adapter * n))


def first_token_seconds(engine: Any, prompt: list[int], lora: Any, max_tokens: int = 2) -> float:
    """Seconds from ``add_request`` to the step that returns the request's first token (the
    engine idle otherwise: nothing else is queued). Runs the request to its end."""
    from loraplex import SamplingParams

    rid = engine.next_request_id()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params, lora_request=lora)
    first: float | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            if out.error is not None:
                raise RuntimeError(f"TTFT request failed: {out.error}")
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the TTFT request produced no token")
    return first


def measure_ttft(
    llm: Any, args: argparse.Namespace, wl: Workload, probes: list[Any], fresh: list[Any]
) -> dict[str, Any]:
    """TTFT of one request (``--ttft-prompt`` tokens) on the idle engine: with an adapter that is
    registered but was never used (its tier recorded: ``disk`` = only in the store), the same
    adapter again (now loaded), the base model, and an adapter never registered (the request's
    own first use validates and registers it)."""
    import statistics

    engine = llm.llm_engine
    prompt = [100 + (37 * i) % 20000 for i in range(args.ttft_prompt)]
    first_token_seconds(engine, prompt, None)  # untimed: the shape's kernels built once
    tiers = engine.lora_tiers()
    res: dict[str, Any] = {"prompt_tokens": len(prompt), "probes": []}
    for lo in probes:
        tier = tiers.get(lo.int_id, "unregistered")
        cold = first_token_seconds(engine, prompt, lo)
        warm = first_token_seconds(engine, prompt, lo)
        base = first_token_seconds(engine, prompt, None)
        res["probes"].append(
            {
                "adapter": lo.name,
                "tier_before": tier,
                "ttft_s": cold,
                "ttft_loaded_s": warm,
                "ttft_base_s": base,
            }
        )
    first_use = [first_token_seconds(engine, prompt, lo) for lo in fresh]
    store = [p["ttft_s"] for p in res["probes"] if p["tier_before"] == "disk"]
    med = statistics.median
    res["summary"] = {
        "tiers_before": sorted({p["tier_before"] for p in res["probes"]}),
        "store_only_ms": round(1000 * med(store), 1) if store else None,
        "registered_unused_ms": round(1000 * med([p["ttft_s"] for p in res["probes"]]), 1)
        if res["probes"]
        else None,
        "loaded_ms": round(1000 * med([p["ttft_loaded_s"] for p in res["probes"]]), 1)
        if res["probes"]
        else None,
        "base_ms": round(1000 * med([p["ttft_base_s"] for p in res["probes"]]), 1) if res["probes"] else None,
        "first_use_ms": round(1000 * med(first_use), 1) if first_use else None,
    }
    res["first_use_s"] = first_use
    return res


@dataclass
class ManyRun:
    """One timed loraplex run of the many-adapters mode."""

    config: str
    n: int
    mix: str
    result: RunResult
    assign: list[int]
    base_key: int  # requests of the base workload it is compared with


def run_many(args: argparse.Namespace, argv: list[str] | None, model_dir: Path) -> dict[str, Any]:
    """The many-adapters mode: N distinct adapters (r=8 on q/v by default), each engine
    configuration (default, max_loras caps) against its own base-model runs; TTFT of a request
    whose adapter is only in the store."""
    import torch

    from loraplex import LLM, LoRARequest, SamplingParams

    progress = not args.no_progress
    ns = args.many_adapters
    n_max = max(ns)
    sizes = {n: many_requests(args, n) for n in ns}
    args.num_requests = max(sizes.values())
    wl = build_workload(args, model_dir)  # every N runs the first sizes[n] requests of this one
    args.num_requests = None if not any(sizes[n] != args.num_requests for n in ns) else args.num_requests
    cap_k = args.capped_requests
    print(f"workload: {wl.description}", flush=True)
    assignments: dict[tuple[int, str], list[int]] = {}
    for n in ns:
        r = sizes[n]
        for mix in args.mixes:
            if mix == "uniform":
                a = uniform_assignment(r, n, args.popularity_seed)
            else:
                a = assign_adapters(r, n, args.alpha, args.popularity, args.popularity_seed)
            assignments[(n, mix)] = a
            counts = adapter_histogram(a, n)
            used = [c for c in counts if c]
            print(
                f"  N={n} {mix}: {r} requests, {len(used)} distinct adapters used, requests per used "
                f"adapter {min(used)}-{max(used)}"
                + (f", first {cap_k}: {len(set(a[:cap_k]))} distinct" if cap_k and cap_k < r else ""),
                flush=True,
            )

    tmp_root = None
    if args.adapter_dir:
        adapter_root = Path(args.adapter_dir)
        adapter_root.mkdir(parents=True, exist_ok=True)
    else:
        tmp_root = Path(tempfile.mkdtemp(prefix="loraplex-manylora-"))
        adapter_root = tmp_root
    probes_per_config = args.ttft_probes
    n_probe = 2 * probes_per_config * len(args.configs)  # registered-unused + never-registered, per engine
    configs: dict[str, dict[str, Any]] = {}
    runs: list[ManyRun] = []
    bases: dict[tuple[str, int], RunResult] = {}
    try:
        with stopwatch() as t_make:
            paths = make_adapters(args, model_dir, adapter_root, n_max + n_probe)
        size_mb = sum(f.stat().st_size for f in paths[0].iterdir()) / 2**20
        print(
            f"\nmade {n_max} + {n_probe} adapters (rank {args.rank}, lora_alpha {args.lora_alpha}, "
            f"{', '.join(args.target_modules)}; {size_mb:.2f} MiB each) in {t_make['seconds']:.1f} s",
            flush=True,
        )
        loras = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(paths)]
        work, extra = loras[:n_max], loras[n_max:]
        done: dict[str, RunResult] = {}
        for ci, cap in enumerate(args.configs):
            label = config_label(cap)
            # A cap below the largest N forces adapters through the slots (the slow runs); a cap
            # of at least N never limits a step's adapters and runs the whole workload.
            limit = cap_k if (cap is not None and cap < n_max and cap_k) else None
            eargs = many_engine_args(args, cap)
            print(f"\n== loraplex {label} (engine args {eargs}) ==", flush=True)
            torch.manual_seed(0)
            llm = LLM(model=args.model, **eargs)
            info: dict[str, Any] = {"engine_args": dict(eargs), "request_limit": limit}
            runtime = llm.llm_engine.lora_manager
            assert runtime is not None
            info["resolved"] = {
                "attention": llm.llm_engine.runner.attn.name,
                "linear": llm.llm_engine.model.linear.name,
                "lora": runtime.backend.name,
                "max_loras": llm.llm_engine.config.max_loras,
                "max_cpu_loras": llm.llm_engine.config.cpu_lora_capacity,
                "max_lora_rank": llm.llm_engine.config.max_lora_rank,
            }
            print(f"resolved: {info['resolved']}", flush=True)
            k = probes_per_config
            probes = extra[2 * k * ci : 2 * k * ci + k]
            fresh = extra[2 * k * ci + k : 2 * k * (ci + 1)]
            with stopwatch() as t_reg:
                for lo in [*probes, *work]:  # probes first: the least recently used afterwards
                    llm.add_lora(lo)
            info["register_seconds"] = round(t_reg["seconds"], 2)
            print(f"registered {len(probes) + len(work)} adapters in {t_reg['seconds']:.1f} s", flush=True)
            keys = sorted({min(sizes[n], limit or sizes[n]) for n in ns})
            if not args.no_warmup:
                used = sorted(
                    {
                        a
                        for (n, _m), asg in assignments.items()
                        for a in asg[: min(sizes[n], limit or sizes[n])]
                    }
                )
                with stopwatch() as t_warm:
                    llm.generate(
                        [[100 + i for i in range(16)]] * (len(used) + 1),
                        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                        lora_request=[None, *(work[a] for a in used)],
                        use_tqdm=False,
                    )
                info["warmup_seconds"] = round(t_warm["seconds"], 2)
                print(
                    f"warm-up ({len(used)} adapters, 1 tiny request each): {t_warm['seconds']:.1f} s",
                    flush=True,
                )
            before: dict[int, RunResult] = {}
            for r in keys:
                res = run_loraplex_once(llm, f"{label} base R={r}", _subset(wl, r), [None] * r, progress)
                before[r] = res
                done[res.name] = res
                checkpoint(args.out, argv, done)
                print(
                    f"{res.name}: {res.output_tokens} tok in {res.seconds:.1f} s = {res.tok_s:.1f} tok/s",
                    flush=True,
                )
            for n in ns:
                r = min(sizes[n], limit or sizes[n])
                for mix in args.mixes:
                    asg = assignments[(n, mix)][:r]
                    res = run_loraplex_once(
                        llm, f"{label} N={n} {mix}", _subset(wl, r), [work[a] for a in asg], progress
                    )
                    res.extra["distinct_adapters"] = len(set(asg))
                    runs.append(ManyRun(label, n, mix, res, asg, r))
                    done[res.name] = res
                    checkpoint(args.out, argv, done)
                    print(
                        f"{res.name}: {r} requests ({len(set(asg))} adapters), {res.output_tokens} tok in "
                        f"{res.seconds:.1f} s = {res.tok_s:.1f} tok/s "
                        f"({res.tok_s / before[r].tok_s:.2f}x base before)",
                        flush=True,
                    )
            for r in keys:
                base_runs = [before[r]]
                if not args.no_bracket_base:
                    again = run_loraplex_once(
                        llm, f"{label} base R={r} (after)", _subset(wl, r), [None] * r, progress
                    )
                    done[again.name] = again
                    checkpoint(args.out, argv, done)
                    base_runs.append(again)
                    print(
                        f"{again.name}: {again.tok_s:.1f} tok/s (before {before[r].tok_s:.1f}; "
                        f"outputs identical: {again.outputs == before[r].outputs})",
                        flush=True,
                    )
                pooled = pool_runs(f"{label} base R={r}", base_runs)
                pooled.extra["outputs_identical_before_after"] = all(
                    b.outputs == before[r].outputs for b in base_runs
                )
                bases[(label, r)] = pooled
            if args.ttft_probes:
                info["ttft"] = measure_ttft(llm, args, wl, probes, fresh)
                print(f"TTFT ({label}): {info['ttft']['summary']}", flush=True)
            info["adapter_stats"] = _jsonable_stats(llm)
            configs[label] = info
            llm.shutdown()
            del llm
            gc.collect()

        # ---- PEFT reference on a few requests of the largest N ------------------------------
        peft_check: dict[str, Any] = {}
        k_peft = 0 if args.skip_peft else args.many_peft_requests
        first = next((m for m in runs if m.n == n_max), None)
        if k_peft and first is not None:
            k_peft = min(k_peft, len(first.assign))
            asg = first.assign[:k_peft]
            used = sorted(set(asg))
            print(
                f"\n== PEFT reference: first {k_peft} requests of {first.result.name} "
                f"({len(used)} adapters) =="
            )
            model = load_peft(model_dir, [paths[a] for a in used], args.dtype)
            sub = _subset(wl, k_peft)
            ref = run_peft(model, "PEFT", sub, [paths[a].name for a in asg], args.peft_batch_size, progress)
            del model
            gc.collect()
            base_out = bases[(first.config, first.base_key)].outputs[:k_peft]
            peft_check = {
                "run": first.result.name,
                "agreement": token_agreement(ref.outputs, first.result.outputs[:k_peft]),
                "peft_vs_base": token_agreement(ref.outputs, base_out),
            }
            a, d = peft_check["agreement"], peft_check["peft_vs_base"]
            print(
                f"greedy agreement loraplex vs PEFT ({k_peft} requests): {a['positional']:.1%} "
                f"position-wise, {a['exact_requests']:.1%} of requests identical "
                f"(PEFT vs base model: {d['positional']:.1%})"
            )
    finally:
        if tmp_root is not None:
            shutil.rmtree(tmp_root, ignore_errors=True)

    return report_many(
        args, argv, wl, sizes, assignments, configs, runs, bases, peft_check, size_mb, t_make["seconds"]
    )


def _jsonable_stats(llm: Any) -> dict[str, Any]:
    mgr = llm.llm_engine.lora_manager
    stats = getattr(getattr(mgr, "manager", None), "stats", None)
    if stats is None:
        return {}
    from dataclasses import asdict

    try:
        return dict(asdict(stats()))
    except Exception as exc:  # the adapter internals are being rewritten: never fail the run on them
        return {"error": repr(exc)}


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
    """Checks, tables (printed and as Markdown), JSON and the plot of the many-adapters mode."""
    # Every run produced exactly its requests' lengths.
    counts_ok = all([len(o) for o in m.result.outputs] == wl.max_tokens[: m.base_key] for m in runs) and all(
        [len(o) for o in b.outputs] == wl.max_tokens[:r] for (_c, r), b in bases.items()
    )
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
        agreement[f"{m.config} N={m.n} {m.mix}"] = token_agreement(
            ref.result.outputs[:k], m.result.outputs[:k]
        )
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
                "capped": configs[m.config]["request_limit"] is not None,
            }
        )
    headers = [
        "config",
        "N",
        "mix",
        "requests",
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
                f"{r['requests']}{' (capped)' if r['capped'] else ''}",
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
        "goal": 0.8,
        "min_ratio_to_base": min_ratio,
        "pass": min_ratio is not None and min_ratio >= BAR_VS_BASE,
    }
    print(f"\noutput token counts equal to the workload's: {counts_ok}")
    for name, a in agreement.items():
        print(
            f"greedy agreement {name} vs {ref_label}: {a['positional']:.1%} position-wise, "
            f"{a['exact_requests']:.1%} of {a['num_requests']} requests identical"
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
            f"{'PASS' if bar['pass'] else 'FAIL'}; goal 0.8)"
        )

    report: dict[str, Any] = {
        "benchmark": "multi_lora_throughput",
        "mode": "many_adapters",
        "command": " ".join(
            ["benchmarks/multi_lora_throughput.py", *(argv if argv is not None else sys.argv[1:])]
        ),
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
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, label in enumerate(dict.fromkeys(r["config"] for r in rows)):
        for mix, (marker, ls) in styles.items():
            pts = sorted(
                (r["N"], r["ratio_to_base"], r["capped"])
                for r in rows
                if r["config"] == label and r["mix"] == mix
            )
            if not pts:
                continue
            capped = " (first requests only)" if pts[0][2] else ""
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
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    from loraplex import LLM, LoRARequest, SamplingParams
    from loraplex.platform.model.source import resolve_model_dir

    progress = not args.no_progress
    threads = set_torch_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    if args.many_adapters:
        return run_many(args, argv, model_dir)
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
            f"{', '.join(args.target_modules)}; {size_mb:.1f} MiB each) in {t_make['seconds']:.1f} s "
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
            "target_modules": list(args.target_modules),
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
