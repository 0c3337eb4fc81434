"""Timed runs of the multi-LoRA benchmarks: loraplex through ``LLM.generate``, PEFT's
mixed-adapter batches, and what they record.

Engine figures come from the engine's published ``EngineStats`` (``llm.llm_engine.stats``:
steps, preemptions, the device pool, the adapter tiers), its config and its runtime info,
never from its parts.

Throughput is output tokens per wall-clock second; output tokens per CPU-second (process CPU
time, all threads) is reported too, as it is less disturbed by other processes on a shared
machine.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import Workload, generate_left_padded, machine_info, stopwatch, write_json


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


# -- the engine, as it publishes itself ------------------------------------------------------
def engine_stats(engine: Any) -> Any:
    """The engine's ``EngineStats`` now. The engine publishes a snapshot after every step;
    commands between steps (``add_lora``, ``abort_request``) change its counters without one,
    so the benchmark (on the engine's thread: ``LLM`` has no other) publishes first."""
    engine.publish_stats()
    return engine.stats


def step_counters(engine: Any) -> tuple[int, int]:
    """(steps run, preemptions) since start-up."""
    stats = engine_stats(engine)
    return stats.step, stats.num_preemptions


def resolved_backends(engine: Any) -> dict[str, str]:
    """What ``auto`` resolved to (the C kernels on a CPU with a compiler, else torch): the
    kernel registry's choice for the engine's config on its device, the choice the engine's
    assembly makes (``EngineStats`` does not carry it)."""
    from loraplex.kernels.registry import (
        select_attention_backend,
        select_linear_backend,
        select_lora_backend,
    )

    config, device = engine.config, engine.info.device
    return {
        "attention": select_attention_backend(config.attention_backend, device).name,
        "linear": select_linear_backend(config.linear_backend, device).name,
        "lora": select_lora_backend(config.lora_backend, device).name,
    }


# -- loraplex --------------------------------------------------------------------------------
def run_loraplex_once(
    llm: Any, name: str, wl: Workload, loras: list[Any], progress: bool, profile: str | None = None
) -> RunResult:
    """The whole workload submitted at once (``LLM.generate``), greedy, EOS ignored."""
    from loraplex import SamplingParams

    engine = llm.llm_engine
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
    steps0, pre0 = step_counters(engine)
    gc.collect()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    with stopwatch() as t:
        outs = llm.generate(wl.prompts, params, lora_request=loras, use_tqdm=progress)
    if prof is not None and profile:
        prof.disable()
        prof.dump_stats(profile)
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    steps1, pre1 = step_counters(engine)
    return RunResult(
        name,
        t["seconds"],
        t["cpu_seconds"],
        output_tokens=sum(len(o) for o in outputs),
        outputs=outputs,
        generated_tokens=sum(len(o) for o in outputs),
        extra={"engine_steps": steps1 - steps0, "preemptions": pre1 - pre0},
    )


def aligned(a: list[list[int]], b: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Each request's tokens that both runs generated: a time-limited run cuts requests short, and a
    greedy request cut short must be a prefix of the same request run to its end. Requests with
    no token in one of the runs are left out."""
    pairs = [(x[: len(y)], y[: len(x)]) for x, y in zip(a, b, strict=True) if x and y]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def same_outputs(a: RunResult, b: RunResult) -> bool:
    """Same tokens wherever both runs generated one (everywhere without a time limit)."""
    x, y = aligned(a.outputs, b.outputs)
    return x == y


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


# -- PEFT ------------------------------------------------------------------------------------
def load_peft(model_dir: Path, paths: list[Path], dtype: str) -> Any:
    """``PeftModel`` with every adapter of ``paths`` loaded (named by folder), EOS disabled."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    td = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=td, attn_implementation="sdpa")
    model: Any = PeftModel.from_pretrained(base, str(paths[0]), adapter_name=paths[0].name)
    for path in paths[1:]:
        model.load_adapter(str(path), adapter_name=path.name)
    model.eval()
    model.base_model.model.generation_config.eos_token_id = None  # EOS ignored
    return model


def peft_batch(
    model: Any, prompts: list[list[int]], names: list[str], max_new: int, pad_id: int
) -> list[list[int]]:
    """PEFT's mixed-adapter batch: one static left-padded batch, adapter ``names[i]`` per row."""
    return generate_left_padded(model, prompts, max_new, pad_id, adapter_names=names)


def run_peft(
    model: Any, name: str, wl: Workload, names: list[str], batch_size: int, progress: bool
) -> RunResult:
    """Static batches of ``batch_size``, each decoded to its largest ``max_tokens``; only each
    request's own ``max_tokens`` count."""
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
            rows = peft_batch(model, prompts, names[lo : lo + batch_size], max(wants), pad)
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


# -- output ----------------------------------------------------------------------------------
def command_line(script: str, argv: list[str] | None) -> str:
    """How the run was started: ``benchmarks/<script>.py`` and its flags."""
    return " ".join([f"benchmarks/{script}.py", *(argv if argv is not None else sys.argv[1:])])


def checkpoint(path: str, script: str, argv: list[str] | None, runs: dict[str, RunResult]) -> None:
    """Write the runs finished so far (``"partial": true``): a killed run still leaves its figures."""
    write_json(
        path,
        {
            "benchmark": "multi_lora_throughput",
            "partial": True,
            "command": command_line(script, argv),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine_info(),
            "runs": {k: r.summary() for k, r in runs.items()},
        },
    )
