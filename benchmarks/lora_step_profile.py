"""Where a decode step's LoRA time goes: the same batch of decodes on the base model and on adapters.

The figures behind the "step profile" tables of issue 45 in ``docs/benchmarks.md``::

    .venv/bin/python benchmarks/lora_step_profile.py                        # float and quant, ~1 minute
    .venv/bin/python benchmarks/lora_step_profile.py --paths float --steps 10

For each base path (``float``: float32 HF folder, ``quantization="none"``; ``quant``: the bundled
GGUF, default ``gguf``) one engine (defaults, prefix caching off, LoRA on) runs ``--seqs`` (32)
requests with prompts of 48 tokens until all of them decode, then times ``--steps`` (30) decode
steps of that batch, once with every request on the base model and once per workload:

* ``r16x32``: 32 rank-16 adapters on all seven projections, one per sequence;
* ``r8q/v``: 32 rank-8 adapters on q_proj / v_proj, one per sequence (the 512 / 1,024 adapter
  workloads' kind of adapter: a decode batch holds up to 32 distinct ones either way);
* ``one``: one rank-16 all-seven adapter for every sequence.

Timers (``perf_counter`` around the call, medians over the steps, milliseconds per step):
``prefill`` (the steps that run the prompts: 32 x 48 tokens, then three decode steps; one
sample, not a median), ``step`` (``engine.step``: scheduling, batch building, forward, LM
head, sampling, outputs),
``forward`` (the model's decoder stack), ``lora hook`` (the LoRA applier's calls from the
stack: grouping, page passes, buffer look-up, the kernel) and ``lora kernel`` (the C grouped
kernel alone), each per projection group, and ``lora plan`` (the per-step plan, where one is
built). The LoRA cost of a step is ``forward(lora) - forward(base)``; ``hook - kernel`` is what
is paid around the arithmetic.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, set_torch_threads, write_json  # noqa: E402
from benchmarks.lora_vs_base import ALL_SEVEN, adapters_for, engine_kwargs  # noqa: E402

PROFILE_WORKLOADS = {"r16x32": (32, 16, ALL_SEVEN, False), "r8q/v": (32, 8, ("q_proj", "v_proj"), False)}
PROFILE_WORKLOADS["one"] = (1, 16, ALL_SEVEN, True)


class StepTimers:
    """Seconds per name within the current step; a list of per-step totals per name."""

    def __init__(self) -> None:
        self.current: dict[str, float] = collections.defaultdict(float)
        self.steps: dict[str, list[float]] = collections.defaultdict(list)

    def wrap(self, obj: Any, attr: str, name: Callable[..., str] | str) -> Callable[[], None]:
        original = getattr(obj, attr)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                key = name(*args, **kwargs) if callable(name) else name
                self.current[key] += time.perf_counter() - start

        setattr(obj, attr, timed)
        return lambda: setattr(obj, attr, original)

    def end_step(self, names: set[str]) -> None:
        for key in names | set(self.current):
            self.steps[key].append(self.current.get(key, 0.0))
        self.current.clear()

    def medians_ms(self) -> dict[str, float]:
        return {k: 1e3 * statistics.median(v) for k, v in self.steps.items()}


def profile_batch(engine: Any, prompts: list[list[int]], loras: list[Any], steps: int) -> dict[str, float]:
    """Median ms per decode step of ``prompts`` (one request each, on ``loras``) by timer."""
    from loraplex import SamplingParams
    from loraplex.kernels.cpu import lora as cpu_lora

    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    ids = [engine.next_request_id() for _ in prompts]
    for rid, prompt, lora in zip(ids, prompts, loras, strict=True):
        engine.add_request(rid, prompt, params, lora_request=lora)
    # Until every request decodes (its prefill and first token done).
    start = time.perf_counter()
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(3):  # the last prefill chunks, then decodes only
        engine.step()
    prefill_s = time.perf_counter() - start  # the prompts' steps (and the first decodes)
    timers = StepTimers()
    undo = [
        timers.wrap(engine.runner.model, "forward", "forward"),
        timers.wrap(cpu_lora, "lora_grouped_cpu", lambda y, x, w, g: f"lora kernel {_group_of(w)}"),
    ]
    if engine.lora_runtime is not None:
        undo.append(timers.wrap(engine.lora_runtime, "apply", lambda i, g, *a: f"lora hook {g}"))
        plan = getattr(engine.lora_runtime, "plan_step", None)
        if plan is not None:
            undo.append(timers.wrap(engine.lora_runtime, "plan_step", "lora plan"))
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        timers.current["step"] += time.perf_counter() - start
        timers.end_step({"step", "forward"})
    for u in undo:
        u()
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return {**timers.medians_ms(), "prefill": 1e3 * prefill_s}


def _group_of(weights: Any) -> str:
    # The fused projection a packed-weights object serves, by its output width (SmolLM2's).
    return {960: "qkv", 576: "o|down", 3072: "gate_up", 192: "qkv", 768: "qkv"}.get(
        weights.out_features, str(weights.out_features)
    )


def run_path(path: str, args: argparse.Namespace, model_dir: Path, root: Path) -> dict[str, Any]:
    from loraplex import LLM, LoRARequest
    from loraplex.platform.model.source import resolve_model_dir

    llm = LLM(**engine_kwargs(path, resolve_model_dir(None), args.threads, args.page_rank))
    engine = llm.llm_engine
    prompts = [[1000 + 37 * i + j for j in range(48)] for i in range(args.seqs)]
    out: dict[str, Any] = {}
    next_id = 1
    for name in ["base", *args.workloads]:
        if name == "base":
            loras: list[Any] = [None] * args.seqs
        else:
            count, rank, targets, single = PROFILE_WORKLOADS[name]
            paths = adapters_for(root, model_dir, count, rank, targets)
            reqs = [LoRARequest(f"{p.name}-{name}", next_id + i, str(p)) for i, p in enumerate(paths)]
            next_id += len(paths)
            loras = [reqs[0] if single else reqs[i % count] for i in range(args.seqs)]
        profile_batch(engine, prompts, loras, 2)  # warm: every adapter resident, paths touched
        gc.collect()
        out[name] = profile_batch(engine, prompts, loras, args.steps)
        print(
            f"[{path}] {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(out[name].items())), flush=True
        )
    del llm, engine
    gc.collect()
    return out


def table(path: str, res: dict[str, dict[str, float]]) -> str:
    base = res["base"]
    keys = sorted({k for v in res.values() for k in v if k.startswith("lora")})
    headers = ["workload", "prefill ms", "decode step ms", "forward ms", "forward - base", *keys]
    rows = []
    for name, v in res.items():
        rows.append(
            [
                name,
                v["prefill"],
                v["step"],
                v["forward"],
                v["forward"] - base["forward"],
                *[v.get(k, 0.0) for k in keys],
            ]
        )
    return f"{path}\n" + format_table(headers, rows, floatfmt=".2f")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paths", default="float,quant")
    p.add_argument("--workloads", default=",".join(PROFILE_WORKLOADS))
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--page-rank", type=int, default=None, help="lora_page_rank (default: the engine's)")
    p.add_argument("--adapter-dir", default=None)
    p.add_argument("--out", default=str(RESULTS_DIR / "lora_step_profile.json"))
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    set_torch_threads(args.threads)
    from loraplex.platform.model.source import resolve_model_dir

    model_dir = resolve_model_dir(None)
    root = Path(args.adapter_dir or Path(tempfile.gettempdir()) / "loraplex-lora-vs-base")
    report: dict[str, Any] = {"machine": machine_info(), "seqs": args.seqs, "steps": args.steps, "paths": {}}
    for path in args.paths.split(","):
        report["paths"][path] = run_path(path, args, model_dir, root)
    for path, res in report["paths"].items():
        print(table(path, res))
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
