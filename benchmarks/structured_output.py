"""Guided decoding's cost: the same requests with and without a JSON schema, side by side.

One engine (the bundled SmolLM2 unless ``--model``), chat prompts asking for JSON. For each
concurrency (8 and 32 requests submitted at once) every round runs the requests twice, in
alternating order: ``free`` (no constraint) and ``schema`` (a JSON schema: an array of at
least 50 person objects, so every answer runs to exactly ``max_tokens``, as the free ones do
with EOS ignored; both make the same number of tokens and steps). Sampled (temperature 0.8,
seeded): a sampled row gets its whole mask applied, the costly case (a greedy row whose argmax
the grammar allows is left alone). The prefix cache is reset before every run::

    .venv/bin/python benchmarks/structured_output.py                  # the recorded run
    .venv/bin/python benchmarks/structured_output.py --rounds 1 --max-tokens 16   # quick

Reported per concurrency: output tokens/s of each, the median per-round ratio schema / free
(and its range), and the masks' cost per token per sequence: computing it on the worker
thread (overlapped with the forward), waiting for it after the forward and applying it to the
logits (both on the engine thread).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, set_torch_threads, write_json  # noqa: E402
from loraplex import SamplingParams  # noqa: E402
from loraplex.platform.engine.config import EngineConfig  # noqa: E402
from loraplex.platform.engine.engine import LLMEngine  # noqa: E402
from loraplex.platform.engine.sampling_params import StructuredOutputsParams  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "admin"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": PERSON, "minItems": 50}
TOPICS = ["employees", "customers", "students", "players", "authors", "doctors", "pilots", "chefs"]


def prompts(engine: LLMEngine, count: int) -> list[list[int]]:
    tok = engine.tokenizer
    out = []
    for i in range(count):
        ask = f"List {TOPICS[i % len(TOPICS)]} #{i} as a JSON array of people with name, age, city, admin."
        text = tok.apply_chat_template(
            [{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True
        )
        out.append(list(tok.encode(text, add_special_tokens=False)))
    return out


def run(
    engine: LLMEngine, batch: list[list[int]], max_tokens: int, constrained: bool, tag: str
) -> dict[str, float]:
    """Submit ``batch`` at once and step until done: output tokens, seconds, mask counters."""
    engine.reset_prefix_cache()
    structured = StructuredOutputsParams(json=SCHEMA) if constrained else None
    for i, prompt in enumerate(batch):
        params = SamplingParams(
            temperature=0.8,
            seed=i,
            max_tokens=max_tokens,
            ignore_eos=not constrained,
            structured_outputs=structured,
        )
        engine.add_request(f"{tag}-{i}", prompt, params)
    masks0, compute0, wait0, apply0 = engine.grammar_mask_times
    tokens = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                tokens += sum(len(c.token_ids) for c in out.outputs)
    seconds = time.perf_counter() - started
    masks, compute, wait, apply = engine.grammar_mask_times
    return {
        "tokens": tokens,
        "seconds": seconds,
        "masks": masks - masks0,
        "compute_s": compute - compute0,
        "wait_s": wait - wait0,
        "apply_s": apply - apply0,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled SmolLM2)")
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS_DIR / "structured_output.json"))
    args = parser.parse_args(argv)
    set_torch_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=max(levels), kv_cache_memory=512 << 20))
    engine.grammars.compile(StructuredOutputsParams(json=SCHEMA))  # compiled once, as a server's cache would
    results: dict[str, Any] = {}
    rows = []
    for level in levels:
        batch = prompts(engine, level)
        run(engine, batch[:2], 4, True, f"warm{level}")
        run(engine, batch[:2], 4, False, f"warmf{level}")
        per: dict[str, list[dict[str, float]]] = {"free": [], "schema": []}
        for r in range(args.rounds):
            order = ("free", "schema") if r % 2 == 0 else ("schema", "free")
            for kind in order:
                per[kind].append(run(engine, batch, args.max_tokens, kind == "schema", f"{kind}{level}-{r}"))
        ratios = [
            (s["tokens"] / s["seconds"]) / (f["tokens"] / f["seconds"])
            for f, s in zip(per["free"], per["schema"], strict=True)
        ]
        tok_s = {k: sum(x["tokens"] for x in v) / sum(x["seconds"] for x in v) for k, v in per.items()}
        masks = sum(x["masks"] for x in per["schema"])
        us = {
            k: 1e6 * sum(x[f"{k}_s"] for x in per["schema"]) / max(masks, 1)
            for k in ("compute", "wait", "apply")
        }
        results[str(level)] = {
            "free_tok_s": tok_s["free"],
            "schema_tok_s": tok_s["schema"],
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "ratios": ratios,
            "tokens_per_run": per["free"][0]["tokens"],
            "masks": masks,
            "mask_compute_us_per_token_seq": us["compute"],
            "mask_wait_us_per_token_seq": us["wait"],
            "mask_apply_us_per_token_seq": us["apply"],
            "runs": per,
        }
        rows.append(
            [
                level,
                tok_s["free"],
                tok_s["schema"],
                f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})",
                us["compute"],
                us["wait"],
                us["apply"],
            ]
        )
    headers = ["concurrent", "free tok/s", "schema tok/s", "ratio median (range)"]
    headers += ["mask compute us/tok/seq", "wait us", "apply us"]
    print(format_table(headers, rows, ".1f"))
    report = {
        "args": vars(args),
        "machine": machine_info(),
        "schema": SCHEMA,
        "results": results,
    }
    write_json(args.out, report)
    engine.shutdown()
    return report


if __name__ == "__main__":
    main()
