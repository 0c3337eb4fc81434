"""Offline throughput: loraplex vs HF static batching vs HF continuous batching.

One process, one seeded workload, the same model weights, dtype and torch thread
count for every system::

    .venv/bin/python benchmarks/offline_throughput.py                      # full run
    .venv/bin/python benchmarks/offline_throughput.py --num-requests 16 \\
        --max-prompt 64 --max-output 32                                     # quick check

Systems (``--peers``):

* ``loraplex``: ``LLM.generate`` with ``SamplingParams(temperature=0, max_tokens=m_i,
  ignore_eos=True)``; the whole workload is submitted at once.
* ``hf_static``: HF ``model.generate`` on static batches of ``--hf-batch-size`` (16)
  requests in workload order, left-padded, greedy; each batch runs for the largest
  ``max_tokens`` in it (a static server cannot retire a row early). Only each
  request's own ``max_tokens`` count as output tokens; the extra tokens the batch
  generates for shorter requests are reported as waste.
* ``hf_cb``: HF transformers' continuous batching (the manager behind
  ``model.generate_batch``). ``generate_batch`` takes one ``max_new_tokens`` for all
  requests, so this drives the same manager the way ``generate_batch`` does
  (``continuous_batching_context_manager`` + ``add_request`` + ``get_result``) but
  gives each request its own ``max_new_tokens``; EOS is disabled with
  ``eos_token_id=-1``. Manager start-up (cache allocation) is outside the timing.

EOS is ignored everywhere, so request i produces exactly ``max_tokens[i]`` tokens in
every system; the script checks that and prints the counts.

KV memory utilization is sampled from loraplex after every engine step: tokens
stored (sum of ``num_computed_tokens`` over running sequences) divided by token
slots reserved (blocks in use x block size). The naive figure divides the same
tokens stored by what an allocator reserving ``prompt_len + max_tokens`` up front
for each running request would hold for the same schedule.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
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

ALL_SYSTEMS = ("loraplex", "hf_static", "hf_cb")
BAR = {"hf_static": 4.0, "hf_cb": 1.5}  # acceptance bar: loraplex / peer output tok/s
DEFAULT_OUT = RESULTS_DIR / "offline_throughput.json"


@dataclass
class SystemResult:
    name: str
    seconds: float
    output_tokens: int  # useful tokens: each request's own max_tokens
    prompt_tokens: int
    outputs: list[list[int]] = field(repr=False)
    generated_tokens: int = 0  # everything the system decoded (static batching pads)
    cpu_seconds: float = 0.0  # process CPU time over the timed region (all threads)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def total_tok_s(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 3),
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "output_tok_s": round(self.output_tok_s, 2),
            "cpu_seconds": round(self.cpu_seconds, 2),
            "output_tok_per_cpu_s": round(self.output_tokens / self.cpu_seconds, 2)
            if self.cpu_seconds > 0
            else 0.0,
            "total_tok_s": round(self.total_tok_s, 2),
            "requests_per_s": round(len(self.outputs) / self.seconds, 4) if self.seconds > 0 else 0.0,
            **self.extra,
        }


# -- arguments -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--model", default=None, help="HF model directory (default: the bundled SmolLM2-135M-Instruct)"
    )
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--peers", default=",".join(ALL_SYSTEMS), help=f"comma list out of {','.join(ALL_SYSTEMS)}"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--quantization",
        default="none",
        choices=["auto", "none", "gguf", "gguf_a8", "int8"],
        help="loraplex's weight storage (EngineConfig.quantization); none = the float path HF also runs",
    )
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads for every system")
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "cpu"],
        help="loraplex attention kernels on the CPU (auto: the C decode kernel when it builds)",
    )
    p.add_argument(
        "--linear-backend",
        default="auto",
        choices=["auto", "torch", "cpu"],
        help="loraplex dense projections on the CPU (auto: the C packed-panel kernel when it builds)",
    )
    # loraplex engine
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV pool for loraplex and HF CB (GiB)")
    # peers
    p.add_argument("--hf-batch-size", type=int, default=16, help="static HF batch size")
    p.add_argument(
        "--hf-cb-max-batch-tokens",
        type=int,
        default=None,
        help="HF CB max_batch_tokens (default: --max-num-batched-tokens)",
    )
    p.add_argument("--hf-cb-page-size", type=int, default=256, help="HF CB page size (its default)")
    p.add_argument("--no-warmup", action="store_true", help="skip the short untimed warm-up of each system")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results path")
    p.add_argument("--plot", default=None, help="PNG path for the throughput and KV-utilization figure")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    args = p.parse_args(argv)
    systems = [s.strip() for s in args.peers.split(",") if s.strip()]
    bad = [s for s in systems if s not in ALL_SYSTEMS]
    if bad or not systems:
        p.error(f"--peers: unknown {bad}; choose from {ALL_SYSTEMS}")
    args.systems = systems
    if args.hf_cb_max_batch_tokens is None:
        args.hf_cb_max_batch_tokens = args.max_num_batched_tokens
    return args


# -- model facts ---------------------------------------------------------------------------
def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """K and V of one token over all layers, from the HF config."""
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * _torch_dtype(dtype).itemsize


def build_workload(args: argparse.Namespace, model_dir: Path) -> Workload:
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    wl = random_token_workload(
        args.num_requests,
        (args.min_prompt, args.max_prompt),
        (args.min_output, args.max_output),
        vocab,
        seed=args.seed,
        exclude_ids=tok.all_special_ids,
    )
    return wl


# -- loraplex ------------------------------------------------------------------------------
class KVSampler:
    """Wraps ``engine.step`` to record KV usage after every step."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.samples: list[dict[str, float]] = []
        self._orig = engine.step
        self._t0 = time.perf_counter()

    def __enter__(self) -> KVSampler:
        self._t0 = time.perf_counter()
        self.engine.step = self._step
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.step = self._orig

    def _step(self) -> Any:
        outs = self._orig()
        eng = self.engine
        bm = eng.kv.block_manager
        running = eng.scheduler.running
        stored = sum(s.num_computed_tokens for s in running)
        naive = sum(s.num_prompt_tokens + (s.params.max_tokens or 0) for s in running)
        used_blocks = bm.num_blocks - bm.num_free_blocks
        self.samples.append(
            {
                "t": time.perf_counter() - self._t0,
                "running": len(running),
                "waiting": len(eng.scheduler.waiting),
                "tokens_stored": stored,
                "slots_reserved_paged": used_blocks * bm.block_size,
                "slots_reserved_naive": naive,
            }
        )
        return outs


def run_loraplex(
    args: argparse.Namespace, wl: Workload, progress: bool
) -> tuple[SystemResult, dict[str, Any]]:
    from loraplex import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=int(args.kv_cache_gib * 2**30),
        num_threads=args.threads,
        attention_backend=args.attention_backend,
        linear_backend=args.linear_backend,
        quantization=args.quantization,
        seed=0,
    )
    engine = llm.llm_engine
    if not args.no_warmup:
        llm.generate(
            [[100 + i for i in range(16)]] * 2,
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
    steps0, pre0 = engine.num_steps, engine.scheduler.num_preemptions
    with KVSampler(engine) as sampler, stopwatch() as t:
        outs = llm.generate(wl.prompts, params, use_tqdm=progress)
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    bm = engine.kv.block_manager
    pool = {
        "num_blocks": bm.num_blocks,
        "block_size": bm.block_size,
        "budget_slots": bm.num_blocks * bm.block_size,
        "kv_bytes_per_block": engine.info.kv_bytes_per_block,
    }
    res = SystemResult(
        "loraplex",
        t["seconds"],
        output_tokens=sum(len(o) for o in outputs),
        prompt_tokens=wl.num_prompt_tokens,
        outputs=outputs,
        generated_tokens=sum(len(o) for o in outputs),
        cpu_seconds=t["cpu_seconds"],
        extra={
            "engine_steps": engine.num_steps - steps0,
            "preemptions": engine.scheduler.num_preemptions - pre0,
            "max_running": max((s["running"] for s in sampler.samples), default=0),
            "engine_args": {
                "block_size": args.block_size,
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "kv_cache_gib": args.kv_cache_gib,
                "num_kv_blocks": bm.num_blocks,
                "attention_backend": engine.runner.attn.name,
                "linear_backend": engine.model.linear.name,
            },
        },
    )
    del llm, engine
    gc.collect()
    return res, {"pool": pool, "samples": sampler.samples}


# -- HF transformers -----------------------------------------------------------------------
def load_hf_model(model_dir: Path, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=_torch_dtype(dtype), attn_implementation="sdpa"
    )
    model.eval()
    # No EOS at all: HF fills unset generate() arguments from this config, so clear it here.
    model.generation_config.eos_token_id = None
    return model


def _pad_id(model: Any) -> int:
    pid = model.config.pad_token_id
    return int(pid) if pid is not None else 0


def run_hf_static(args: argparse.Namespace, wl: Workload, model_dir: Path, progress: bool) -> SystemResult:
    from tqdm.auto import tqdm

    model = load_hf_model(model_dir, args.dtype)
    pad = _pad_id(model)
    if not args.no_warmup:
        generate_left_padded(model, [[100 + i for i in range(16)]] * 2, 4, pad)
    bs = args.hf_batch_size
    outputs: list[list[int]] = []
    generated = 0
    bar = tqdm(total=len(wl), desc="hf_static", unit="req", disable=not progress)
    useful = 0
    with stopwatch() as t:
        for lo in range(0, len(wl), bs):
            prompts = wl.prompts[lo : lo + bs]
            wants = wl.max_tokens[lo : lo + bs]
            rows = generate_left_padded(model, prompts, max(wants), pad)
            generated += sum(len(r) for r in rows)
            for row, m in zip(rows, wants, strict=True):
                if len(row) < m:
                    raise RuntimeError(f"hf_static produced {len(row)} tokens for a request wanting {m}")
                outputs.append(row[:m])
            useful += sum(wants)
            bar.update(len(prompts))
            elapsed = bar.format_dict.get("elapsed") or 0.0
            if elapsed:
                bar.set_postfix(out_tok_s=f"{useful / elapsed:.0f}")
    bar.close()
    del model
    gc.collect()
    return SystemResult(
        "hf_static",
        t["seconds"],
        output_tokens=sum(len(o) for o in outputs),
        prompt_tokens=wl.num_prompt_tokens,
        outputs=outputs,
        generated_tokens=generated,
        cpu_seconds=t["cpu_seconds"],
        extra={
            "batch_size": bs,
            "wasted_output_tokens": generated - sum(len(o) for o in outputs),
            "padding": "left",
            "per_batch_max_new_tokens": "max max_tokens in the batch",
        },
    )


def run_hf_cb(
    args: argparse.Namespace, wl: Workload, model_dir: Path, budget_slots: int, progress: bool
) -> SystemResult:
    from tqdm.auto import tqdm
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = load_hf_model(model_dir, args.dtype)
    pad = _pad_id(model)
    gen_cfg = GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=pad, max_new_tokens=max(wl.max_tokens)
    )
    page = args.hf_cb_page_size
    cb_cfg = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=max(1, budget_slots // page),  # the same KV budget as loraplex, in tokens
        max_batch_tokens=args.hf_cb_max_batch_tokens,
        max_requests_per_batch=args.max_num_seqs,
        seed=0,
    )
    hints = WorkloadHints(max(wl.prompt_lens), max(wl.max_tokens), len(wl))

    def collect(mgr: Any, ids: list[str], bar: Any | None) -> dict[str, Any]:
        done: dict[str, Any] = {}
        useful = 0
        while len(done) < len(ids):
            r = mgr.get_result(timeout=1)
            if r is None:
                if not mgr.is_running():
                    raise RuntimeError(
                        f"HF CB manager stopped with {len(ids) - len(done)} requests unfinished"
                    )
                continue
            if r.error is not None:
                raise RuntimeError(f"HF CB request {r.request_id} failed: {r.error}")
            if r.is_finished():
                done[r.request_id] = r
                useful += len(r.generated_tokens)
                if bar is not None:
                    bar.update(1)
                    elapsed = bar.format_dict.get("elapsed") or 0.0
                    if elapsed:
                        bar.set_postfix(out_tok_s=f"{useful / elapsed:.0f}")
        return done

    with stopwatch() as t_setup:
        cm = model.continuous_batching_context_manager(
            generation_config=gen_cfg,
            continuous_batching_config=cb_cfg,
            block=True,
            timeout=30,
            workload_hints=hints,
        )
        mgr = cm.__enter__()
    try:
        if not args.no_warmup:
            wids = [
                mgr.add_request(
                    [100 + i for i in range(16)], request_id=f"warm{j}", max_new_tokens=4, eos_token_id=-1
                )
                for j in range(2)
            ]
            collect(mgr, wids, None)
        bar = tqdm(total=len(wl), desc="hf_cb", unit="req", disable=not progress)
        with stopwatch() as t:
            ids = [
                mgr.add_request(p, request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1)
                for i, (p, m) in enumerate(zip(wl.prompts, wl.max_tokens, strict=True))
            ]
            done = collect(mgr, ids, bar)
        bar.close()
    finally:
        cm.__exit__(None, None, None)
    outputs = [list(done[f"r{i}"].generated_tokens) for i in range(len(wl))]
    del model, mgr, cm
    gc.collect()
    return SystemResult(
        "hf_cb",
        t["seconds"],
        output_tokens=sum(len(o) for o in outputs),
        prompt_tokens=wl.num_prompt_tokens,
        outputs=outputs,
        generated_tokens=sum(len(o) for o in outputs),
        cpu_seconds=t["cpu_seconds"],
        extra={
            "setup_seconds_untimed": round(t_setup["seconds"], 2),
            "config": {
                "page_size": page,
                "num_blocks": cb_cfg.num_blocks,
                "max_batch_tokens": args.hf_cb_max_batch_tokens,
                "max_requests_per_batch": args.max_num_seqs,
                "attn_implementation": "sdpa (paged)",
            },
        },
    )


# -- KV memory analysis --------------------------------------------------------------------
def _fit_count(costs: list[int], budget: int) -> int:
    """How many requests, taken in workload order (cycling), fit ``budget`` slots together."""
    if not costs or min(costs) <= 0:
        return 0
    total = n = 0
    while True:
        c = costs[n % len(costs)]
        if total + c > budget:
            return n
        total += c
        n += 1


def kv_analysis(
    wl: Workload, budget_slots: int, block_size: int, samples: list[dict[str, float]] | None
) -> dict[str, Any]:
    """Utilization over the measured loraplex schedule and the largest batch each allocator fits."""
    p, m = wl.prompt_lens, wl.max_tokens
    cap = max(p) + max(m)

    def blocks(n: int) -> int:
        return math.ceil(n / block_size) * block_size

    fits = {
        "naive_max_tokens": _fit_count([a + b for a, b in zip(p, m, strict=True)], budget_slots),
        "naive_max_model_len": _fit_count([cap] * len(wl), budget_slots),
        "paged_at_completion": _fit_count([blocks(a + b) for a, b in zip(p, m, strict=True)], budget_slots),
        "paged_at_mean_progress": _fit_count(
            [blocks(a + math.ceil(b / 2)) for a, b in zip(p, m, strict=True)], budget_slots
        ),
    }
    out: dict[str, Any] = {
        "budget_slots": budget_slots,
        "block_size": block_size,
        "largest_batch": fits,
        "definitions": {
            "utilization": "tokens stored / token slots reserved, sampled after every loraplex step, "
            "mean over steps (steps with nothing running skipped)",
            "paged": "slots reserved = KV blocks in use x block_size",
            "naive": "slots reserved = sum over running requests of prompt_len + max_tokens "
            "(reserved at admission)",
            "largest_batch": f"requests taken in workload order (cycling) until their reservations exceed "
            f"{budget_slots} slots: naive_max_tokens = prompt+max_tokens each; naive_max_model_len = "
            f"max_prompt+max_output ({cap}) each; paged_at_completion = blocks for prompt+max_tokens; "
            "paged_at_mean_progress = blocks for prompt+max_tokens/2 (half-way through decoding)",
        },
    }
    if samples:
        live = [s for s in samples if s["running"] > 0 and s["tokens_stored"] > 0]
        if live:
            util_p = [s["tokens_stored"] / s["slots_reserved_paged"] for s in live]
            util_n = [s["tokens_stored"] / s["slots_reserved_naive"] for s in live]
            out["utilization"] = {
                "paged_mean": sum(util_p) / len(util_p),
                "naive_mean": sum(util_n) / len(util_n),
                "paged_token_weighted": sum(s["tokens_stored"] for s in live)
                / sum(s["slots_reserved_paged"] for s in live),
                "naive_token_weighted": sum(s["tokens_stored"] for s in live)
                / sum(s["slots_reserved_naive"] for s in live),
                "num_samples": len(live),
            }
            out["peak"] = {
                "running": max(s["running"] for s in live),
                "paged_slots": max(s["slots_reserved_paged"] for s in live),
                "naive_slots_same_schedule": max(s["slots_reserved_naive"] for s in live),
                "tokens_stored": max(s["tokens_stored"] for s in live),
            }
    return out


# -- reporting -----------------------------------------------------------------------------
def make_plot(
    path: Path, results: dict[str, SystemResult], kv: dict[str, Any], samples: list[dict[str, float]]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    names = list(results)
    vals = [results[n].output_tok_s for n in names]
    bars = ax.bar(names, vals, color=["#2b7bba" if n == "loraplex" else "#999999" for n in names])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Offline throughput")

    ax = axes[1]
    live = [s for s in samples if s["running"] > 0 and s["tokens_stored"] > 0]
    if live:
        ts = [s["t"] for s in live]
        ax.plot(ts, [s["tokens_stored"] / s["slots_reserved_paged"] for s in live], label="paged (loraplex)")
        ax.plot(
            ts,
            [s["tokens_stored"] / s["slots_reserved_naive"] for s in live],
            label="naive (prompt+max_tokens)",
        )
        ax.set_ylim(0, 1.05)
        ax.legend(loc="lower right")
    ax.set_xlabel("seconds into the loraplex run")
    ax.set_ylabel("tokens stored / slots reserved")
    ax.set_title("KV memory utilization")

    ax = axes[2]
    fits = kv["largest_batch"]
    bars = ax.bar(range(len(fits)), list(fits.values()), color="#5a9e6f")
    ax.set_xticks(range(len(fits)), [k.replace("_", "\n", 1) for k in fits], fontsize=8)
    ax.bar_label(bars)
    ax.set_ylabel("requests")
    ax.set_title(f"Largest batch in {kv['budget_slots']} KV slots")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import faulthandler
    import signal

    import torch

    if not faulthandler.is_enabled():
        faulthandler.enable()  # a crash in a native kernel or HF's CB thread still leaves a trace
    if hasattr(faulthandler, "register") and hasattr(signal, "SIGTERM"):
        faulthandler.register(signal.SIGTERM, chain=True)  # so does being terminated mid-run

    from loraplex.platform.model.source import resolve_model_dir

    progress = not args.no_progress
    threads = set_torch_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    wl = build_workload(args, model_dir)
    print(f"workload: {wl.description}", flush=True)
    print(
        f"  prompt tokens {wl.num_prompt_tokens}, output tokens {wl.num_output_tokens}; dtype {args.dtype}, "
        f"torch threads {threads}",
        flush=True,
    )

    results: dict[str, SystemResult] = {}
    lp_kv: dict[str, Any] | None = None
    budget_slots = int(args.kv_cache_gib * 2**30) // kv_bytes_per_token(model_dir, args.dtype)
    budget_slots -= budget_slots % args.block_size
    for name in args.systems:
        print(f"\n== {name} ==", flush=True)
        torch.manual_seed(0)
        if name == "loraplex":
            res, lp_kv = run_loraplex(args, wl, progress)
            budget_slots = lp_kv["pool"]["budget_slots"]
        elif name == "hf_static":
            res = run_hf_static(args, wl, model_dir, progress)
        else:
            res = run_hf_cb(args, wl, model_dir, budget_slots, progress)
        results[name] = res
        print(
            f"{name}: {res.output_tokens} output tokens in {res.seconds:.1f} s "
            f"= {res.output_tok_s:.1f} tok/s",
            flush=True,
        )
        if name != args.systems[-1]:  # a long run that dies later still leaves these figures
            write_json(
                args.out,
                {
                    "benchmark": "offline_throughput",
                    "partial": True,
                    "machine": machine_info(),
                    "workload": wl.summary(),
                    "results": {n: r.summary() for n, r in results.items()},
                },
            )

    # Output token counts must match the workload exactly, request by request.
    counts = {n: [len(o) for o in r.outputs] for n, r in results.items()}
    counts_ok = all(c == wl.max_tokens for c in counts.values())
    print(
        "\noutput token counts: "
        + ", ".join(f"{n}={sum(c)}" for n, c in counts.items())
        + f" (workload {wl.num_output_tokens}) -> {'equal' if counts_ok else 'MISMATCH'}"
    )
    if not counts_ok:
        for n, c in counts.items():
            bad = [i for i, (a, b) in enumerate(zip(c, wl.max_tokens, strict=True)) if a != b]
            if bad:
                print(
                    f"  {n}: {len(bad)} requests off, e.g. request {bad[0]}: "
                    f"{c[bad[0]]} vs {wl.max_tokens[bad[0]]}"
                )

    rows = [
        [
            n,
            f"{r.seconds:.1f}",
            r.output_tokens,
            r.generated_tokens,
            f"{r.output_tok_s:.1f}",
            f"{r.total_tok_s:.1f}",
            f"{r.cpu_seconds:.1f}",
        ]
        for n, r in results.items()
    ]
    print()
    print(
        format_table(
            ["system", "seconds", "output tok", "decoded tok", "output tok/s", "total tok/s", "CPU s"], rows
        )
    )

    ratios: dict[str, Any] = {}
    if "loraplex" in results:
        lp = results["loraplex"].output_tok_s
        for peer, res in results.items():
            if peer == "loraplex":
                continue
            ratio = lp / res.output_tok_s if res.output_tok_s > 0 else float("inf")
            bar = BAR.get(peer)
            ratios[peer] = {"ratio": round(ratio, 3), "bar": bar, "pass": bar is None or ratio >= bar}
            verdict = "" if bar is None else f"  (bar {bar:.1f}x: {'PASS' if ratio >= bar else 'FAIL'})"
            print(f"loraplex / {peer}: {ratio:.2f}x{verdict}")

    agreement: dict[str, Any] = {}
    if "loraplex" in results:
        ref = results["loraplex"].outputs
        for peer, res in results.items():
            if peer != "loraplex":
                agreement[peer] = token_agreement(res.outputs, ref)
                a = agreement[peer]
                print(
                    f"greedy agreement loraplex vs {peer} ({a['num_requests']} requests, {args.dtype}): "
                    f"{a['positional']:.1%} of tokens match position-wise, "
                    f"{a['prefix']:.1%} before the first "
                    f"divergence, {a['exact_requests']:.1%} of requests identical"
                )

    kv = kv_analysis(wl, budget_slots, args.block_size, lp_kv["samples"] if lp_kv else None)
    print(
        f"\nKV budget: {budget_slots} token slots ({args.kv_cache_gib:g} GiB, block size {args.block_size})"
    )
    if "utilization" in kv:
        u, pk = kv["utilization"], kv["peak"]
        print(
            f"KV utilization (tokens stored / slots reserved, mean over {u['num_samples']} loraplex steps): "
            f"paged {u['paged_mean']:.1%}, naive prompt+max_tokens {u['naive_mean']:.1%}"
        )
        print(
            f"peak over the run: {pk['running']} running, paged {pk['paged_slots']} slots reserved; "
            f"the naive "
            f"allocator would need {pk['naive_slots_same_schedule']} slots for the same schedule"
        )
    lb = kv["largest_batch"]
    print(
        format_table(
            ["allocator (reservation per request)", "largest batch"],
            [
                ["naive: prompt + max_tokens", lb["naive_max_tokens"]],
                [
                    f"naive: max_prompt + max_output ({max(wl.prompt_lens) + max(wl.max_tokens)})",
                    lb["naive_max_model_len"],
                ],
                ["paged: blocks of prompt + max_tokens (at completion)", lb["paged_at_completion"]],
                ["paged: blocks of prompt + max_tokens/2 (mean progress)", lb["paged_at_mean_progress"]],
            ],
        )
    )

    report = {
        "benchmark": "offline_throughput",
        "command": " ".join(
            ["benchmarks/offline_throughput.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k != "systems"},
        "workload": wl.summary(),
        "results": {n: r.summary() for n, r in results.items()},
        "ratios": ratios,
        "output_token_counts": {n: sum(c) for n, c in counts.items()},
        "output_token_counts_equal": counts_ok,
        "greedy_agreement": agreement,
        "kv": kv,
    }
    out = write_json(args.out, report)
    print(f"\nwrote {out}")
    if args.plot:
        make_plot(Path(args.plot), results, kv, lp_kv["samples"] if lp_kv else [])
        print(f"wrote {args.plot}")
    return report


if __name__ == "__main__":
    main()
