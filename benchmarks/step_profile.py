"""Where the time of one short prefill step goes: a question over a cached system prompt.

The figures behind "why the TTFT bar is missed" in ``docs/benchmarks.md``, in two parts::

    .venv/bin/python benchmarks/step_profile.py                 # both parts, ~1 minute
    .venv/bin/python benchmarks/step_profile.py --parts step --requests 4

``step``: an engine with the prefix cache caches a ``--prefix-len`` (1,024) token system
    prompt, then runs ``--requests`` (8) requests of that prompt + a distinct
    ``--question-len`` (32) token question, one at a time. Every backend call of the model
    (each projection by output width, attention, KV writes, the pointwise ops, the LM head)
    and the engine's own stages are timed with ``perf_counter`` around the call (the engine
    runs layer by layer, ``enforce_eager``, so each call goes through the timers); the
    table gives milliseconds per request, calls per request and, for projections, the
    FLOP rate and the weight bytes streamed per second. The timers add a few microseconds
    per call, so the sum slightly overstates the step.

``linear``: the C linear kernel alone over a model-sized working set: every layer's four
    projection weights (SmolLM2's shapes, 30 layers, float32, ~425 MB) and the LM head
    (113 MB), as one forward would read them, for ``--rows`` (1, 4, 32, 256, 1056) rows.
    Rows 1-4 show the weight streaming rate, 1,056 the compute rate, 32 where a short
    prefill lies between them.

Both print tables and write ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, set_torch_threads, write_json  # noqa: E402
from benchmarks.prefix_cache import PromptMaker, greedy, run_alone, ttft_s, warm_up  # noqa: E402

SMOLLM2_PROJECTIONS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
SMOLLM2_LAYERS, SMOLLM2_VOCAB = 30, 49152


class Timers:
    """Accumulated seconds and calls per name, plus the wrapping that feeds them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self.shapes: dict[str, tuple[int, int, int]] = {}  # projection name -> (rows, out, in)

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        original = getattr(obj, attr)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        setattr(obj, attr, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class TimedLinear:
    """A linear backend whose calls are timed per weight shape (one name per projection)."""

    def __init__(self, inner: Any, timers: Timers, names: dict[tuple[int, int], str]) -> None:
        self.inner, self.timers, self.names = inner, timers, names
        self.name = inner.name

    def prepare(self, weight: Any) -> Any:
        return self.inner.prepare(weight)

    def __getattr__(self, attr: str) -> Any:
        # The rest of the backend (``rows``: the embedding lookup of a packed table, on the
        # default GGUF path) untimed, as the inner backend has it.
        return getattr(self.inner, attr)

    def __call__(self, x: Any, weight: Any, bias: Any, out_features: int) -> Any:
        name = self.names.get((out_features, int(x.shape[1])), f"linear {out_features}x{x.shape[1]}")
        start = time.perf_counter()
        try:
            return self.inner(x, weight, bias, out_features)
        finally:
            self.timers.seconds[name] += time.perf_counter() - start
            self.timers.calls[name] += 1
            self.timers.shapes[name] = (int(x.shape[0]), out_features, int(x.shape[1]))


def part_step(args: argparse.Namespace) -> dict[str, Any]:
    from loraplex import LLM

    llm = LLM(
        model=args.model,
        dtype="float32",
        block_size=16,
        num_threads=args.threads,
        attention_backend=args.attention_backend,
        enable_prefix_caching=True,
        # Layer by layer: the CPU graph calls the C kernels directly, past the timers below.
        enforce_eager=True,
        num_kv_blocks=(args.prefix_len + args.question_len) // 16 + 64,
        max_num_batched_tokens=max(2048, args.prefix_len + args.question_len),
        seed=0,
    )
    engine = llm.llm_engine
    maker = PromptMaker(engine.tokenizer)
    system = maker.document(args.prefix_len, "System: you answer questions about the passage below.")
    params = greedy(1)
    warm_up(llm)
    run_alone(engine, "cache-the-prompt", system + maker.question(0, args.question_len), params)

    model, timers = engine.runner.model, Timers()
    arch = model.arch
    h = arch.hidden_size
    names = {  # (out_features, in_features) -> name
        (arch.q_size + 2 * arch.kv_size, h): "projection qkv",
        (h, arch.q_size): "projection o",
        (2 * arch.intermediate_size, h): "projection gate_up",
        (h, arch.intermediate_size): "projection down",
        (arch.vocab_size, h): "LM head (1 row)",
    }
    timed = TimedLinear(model.linear, timers, names)
    model.linear = timed
    for layer in model.layers:
        layer.linear = timed
    for op in ("add_rms_norm", "rotary", "silu_and_mul"):
        timers.wrap(model.pointwise, op, f"pointwise {op}")
    timers.wrap(engine.runner.attn, "forward", "attention")
    timers.wrap(engine.runner.attn, "write_kv", "KV writes")
    timers.wrap(engine.scheduler, "schedule", "engine: schedule")
    timers.wrap(engine.runner, "build_batch", "engine: build batch")
    timers.wrap(model, "forward", "model forward (all layers)")

    ttfts, cached = [], []
    for i in range(args.requests):
        out = run_alone(engine, f"q{i}", system + maker.question(1 + i, args.question_len), params)
        ttfts.append(ttft_s(out))
        cached.append(out.num_cached_tokens)
    llm.shutdown()

    n = args.requests
    rows = []
    for name in sorted(timers.seconds, key=lambda k: -timers.seconds[k]):
        ms = 1e3 * timers.seconds[name] / n
        rate = ""
        if name in timers.shapes:
            m, out_f, in_f = timers.shapes[name]
            s = timers.seconds[name] / timers.calls[name]
            gflops, weight_gbs = 2 * m * out_f * in_f / s / 1e9, 4 * out_f * in_f / s / 1e9
            rate = f"{gflops:.0f} GFLOP/s, {weight_gbs:.1f} GB/s of weights"
        rows.append(
            {
                "part": name,
                "ms_per_request": round(ms, 2),
                "calls_per_request": timers.calls[name] / n,
                "rate": rate,
            }
        )
    return {
        "workload": {"prefix_tokens": args.prefix_len, "question_tokens": args.question_len, "requests": n},
        "num_cached_tokens": cached,
        "ttft_ms": {"mean": 1e3 * statistics.fmean(ttfts), "median": 1e3 * statistics.median(ttfts)},
        "rows": rows,
    }


def part_linear(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from loraplex.kernels.registry import select_linear_backend

    linear = select_linear_backend("auto", torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    layers = [
        {
            name: linear.prepare(torch.randn(out_f, in_f, generator=gen))
            for name, (out_f, in_f) in SMOLLM2_PROJECTIONS.items()
        }
        for _ in range(args.linear_layers)
    ]
    head = linear.prepare(torch.randn(SMOLLM2_VOCAB, 576, generator=gen))
    weight_bytes = 4 * args.linear_layers * sum(o * i for o, i in SMOLLM2_PROJECTIONS.values())
    flops_per_row = 2 * args.linear_layers * sum(o * i for o, i in SMOLLM2_PROJECTIONS.values())
    results = []
    for m in args.rows:
        xs = {name: torch.randn(m, in_f, generator=gen) for name, (_, in_f) in SMOLLM2_PROJECTIONS.items()}

        def forward(xs: dict[str, Any] = xs) -> tuple[float, float]:
            start = time.perf_counter()
            for layer in layers:
                for name, (out_f, _) in SMOLLM2_PROJECTIONS.items():
                    linear(xs[name], layer[name], None, out_f)
            mid = time.perf_counter()
            linear(xs["qkv"][:1], head, None, SMOLLM2_VOCAB)
            return mid - start, time.perf_counter() - mid

        forward()  # untimed: first touch
        times = [forward() for _ in range(args.linear_repeats)]
        proj = statistics.median(t[0] for t in times)
        lm = statistics.median(t[1] for t in times)
        results.append(
            {
                "rows": m,
                "projections_ms": round(1e3 * proj, 2),
                "GFLOP_per_s": round(m * flops_per_row / proj / 1e9, 1),
                "weights_GB_per_s": round(weight_bytes / proj / 1e9, 1),
                "lm_head_1_row_ms": round(1e3 * lm, 2),
            }
        )
    return {
        "backend": linear.name,
        "layers": args.linear_layers,
        "weight_bytes": weight_bytes,
        "rows": results,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="step,linear", help="comma list out of step, linear")
    p.add_argument("--model", default=None, help="model directory or GGUF (default: the bundled SmolLM2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu"])
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 32, 256, 1056])
    p.add_argument("--linear-repeats", type=int, default=3)
    p.add_argument(
        "--linear-layers", type=int, default=SMOLLM2_LAYERS, help="layers of weights (30: SmolLM2)"
    )
    p.add_argument("--out", default=str(RESULTS_DIR / "step_profile.json"))
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    unknown = set(parts) - {"step", "linear"}
    if unknown:
        p.error(f"unknown parts: {sorted(unknown)}")
    threads = set_torch_threads(args.threads)
    runners: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
        "step": part_step,
        "linear": part_linear,
    }
    report: dict[str, Any] = {
        "benchmark": "step_profile",
        "machine": {**machine_info(), "torch_threads": threads},
    }
    for part in parts:
        report[part] = runners[part](args)
    if "step" in report:
        s = report["step"]
        print(
            f"\n{s['workload']['question_tokens']}-token question over "
            f"{s['workload']['prefix_tokens']} cached tokens, "
            f"TTFT mean {s['ttft_ms']['mean']:.1f} ms (cached {set(s['num_cached_tokens'])}):"
        )
        headers = ["part", "ms_per_request", "calls_per_request", "rate"]
        print(format_table(headers, [[r[h] for h in headers] for r in s["rows"]], floatfmt=".2f"))
    if "linear" in report:
        lin = report["linear"]
        print(
            f"\nlinear backend '{lin['backend']}' over {args.linear_layers} layers' projection weights "
            f"({lin['weight_bytes'] / 1e6:.0f} MB) and the LM head:"
        )
        headers = list(lin["rows"][0])
        print(format_table(headers, [[r[h] for h in headers] for r in lin["rows"]]))
    out = write_json(args.out, report)
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    main()
