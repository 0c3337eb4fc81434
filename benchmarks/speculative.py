"""Speculative decoding (prompt lookup or a draft model): the same engine with and without it.

The bundled SmolLM2-135M-Instruct (its GGUF, ``quantization="gguf"``), 2 threads, greedy, one
process; each case runs with speculation off and on (alternating, ``--repeats`` times, median),
and the greedy tokens of both runs are checked equal::

    .venv/bin/python benchmarks/speculative.py                       # the docs' figures
    .venv/bin/python benchmarks/speculative.py --repeats 1 --gen 32  # quick check

Cases:

* ``copy x1``: one stream, a chat prompt asking to repeat / lightly edit a given text (real
  text: paragraphs and code from this repository), ``--gen`` tokens.
* ``random x1``: one stream, a prompt of random tokens (nothing to look up: the policy's
  back-off must keep the cost near zero).
* ``copy x16``: 16 such copy requests at once. Past ``disable_by_batch_size`` (4 by default)
  the policy turns speculation off: at 16 sequences a 2-core CPU is compute-bound, and verifying
  k drafts costs k tokens of compute.

With ``--draft MODEL`` the proposer is that draft model (``method: draft_model``) instead of
prompt lookup; ``--draft bundled`` is the bundled GGUF file, the natural draft of a target served
from its float32 Hugging Face folder (``--quantization none``): the same model at a quarter of
the bytes per token, so it agrees with the target almost always::

    .venv/bin/python benchmarks/speculative.py --draft bundled --quantization none --k 4

Figures: generated tokens / wall second, the ratio on/off, and the acceptance rate (accepted /
proposed draft tokens). llama.cpp's own prompt lookup runs the single-stream cases after ours
when ``llama_cpp`` imports (llama-cpp-python, not a dependency: docs/benchmarks.md says how to
build it here; the script says when it is missing).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, set_torch_threads, write_json  # noqa: E402

DEFAULT_OUT = RESULTS_DIR / "speculative.json"
SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gen", type=int, default=96, help="tokens per request (EOS ends earlier)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrent", type=int, default=16)
    p.add_argument("--k", type=int, default=SPEC["num_speculative_tokens"], help="num_speculative_tokens")
    p.add_argument("--cases", default="copy1,random1,copy16")
    p.add_argument(
        "--disable-by-batch-size", type=int, default=None, help="speculate up to this many running (0: any)"
    )
    p.add_argument("--draft", default=None, help="draft model (folder, .gguf, 'bundled')")
    p.add_argument("--draft-quantization", default="auto", help="the draft's weights (engine values)")
    p.add_argument("--quantization", default="gguf", help="the target's weights (none: its float32 folder)")
    p.add_argument("--out", default=None, help="JSON results (default results/speculative[_draft].json)")
    return p.parse_args(argv)


def source_texts(count: int) -> list[str]:
    """Passages of real text to copy: docstring paragraphs and code from this repository."""
    files = sorted((_ROOT / "loraplex" / "platform" / "engine").glob("*.py"))
    texts: list[str] = []
    for f in files:
        body = f.read_text()
        for chunk in body.split("\n\n"):
            if 250 <= len(chunk) <= 600:
                texts.append(chunk.strip())
    random.Random(0).shuffle(texts)
    return texts[:count]


def copy_prompt(tok: Any, text: str, i: int) -> list[int]:
    asks = [
        "Repeat the following text exactly, word for word:\n\n",
        "Copy this text out again without any change:\n\n",
        "Quote the following passage verbatim:\n\n",
    ]
    msgs = [{"role": "user", "content": asks[i % len(asks)] + text}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return list(tok.encode(text, add_special_tokens=False))


def run_batch(
    llm: Any, prompts: list[list[int]], gen: int, spec_on: bool
) -> tuple[float, list[list[int]], int, int]:
    """(seconds, tokens per request, drafts proposed, accepted) for one batch."""
    from loraplex import SamplingParams

    engine = llm.llm_engine
    spec = engine.speculator
    engine.scheduler.speculator = engine.outputs.speculator = spec if spec_on else None
    before = (spec.counters.num_draft_tokens, spec.counters.num_accepted_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=gen)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    engine.scheduler.speculator = engine.outputs.speculator = spec
    proposed = spec.counters.num_draft_tokens - before[0]
    accepted = spec.counters.num_accepted_tokens - before[1]
    return seconds, [o.outputs[0].token_ids for o in outs], proposed, accepted


def llama_cpp_prompt_lookup(cases: dict[str, list[list[list[int]]]], args: argparse.Namespace) -> Any:
    """llama.cpp's own prompt lookup (llama-cpp-python's ``LlamaPromptLookupDecoding``) on the
    single-stream cases, off and on, same GGUF file, threads and tokens; its cache is reset before
    every run (our prefix caching is off too). Returns the figures, or why there are none."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        print("\nllama.cpp comparison skipped: llama_cpp (llama-cpp-python) is not installed in this venv")
        return "not installed"
    from loraplex.platform.model.source import default_gguf_path

    path = str(default_gguf_path())
    common = dict(
        model_path=path, n_ctx=4096, n_threads=args.threads, n_threads_batch=args.threads, verbose=False
    )
    runners = {
        False: Llama(**common),
        True: Llama(
            **common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=args.k, max_ngram_size=4)
        ),
    }
    figures: dict[str, Any] = {}
    rows = []
    for name, batches in cases.items():
        if len(batches[0]) != 1:
            continue  # llama-cpp-python serves one sequence at a time
        rates: dict[bool, list[float]] = {False: [], True: []}
        for (prompt,) in batches:
            for on, llm in runners.items():
                llm.reset()
                start = time.perf_counter()
                out = llm.create_completion(prompt=prompt, max_tokens=args.gen, temperature=0.0, top_k=1)
                rates[on].append(out["usage"]["completion_tokens"] / (time.perf_counter() - start))
        off, on_ = statistics.median(rates[False]), statistics.median(rates[True])
        figures[name] = dict(off_tok_s=rates[False], on_tok_s=rates[True], ratio=on_ / off)
        rows.append([name, off, on_, on_ / off])
    print("\nllama.cpp (llama-cpp-python, same GGUF), prompt lookup off / on:")
    print(format_table(["case", "off tok/s", "on tok/s", "on/off"], rows, floatfmt=".2f"))
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_torch_threads(args.threads)
    from loraplex import LLM

    spec: dict[str, Any] = dict(SPEC, num_speculative_tokens=args.k)
    if args.draft is not None:
        from loraplex.platform.model.source import default_gguf_path

        draft = str(default_gguf_path()) if args.draft == "bundled" else args.draft
        spec = {"model": draft, "num_speculative_tokens": args.k, "quantization": args.draft_quantization}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size or None
    default_out = DEFAULT_OUT if args.draft is None else DEFAULT_OUT.with_name("speculative_draft.json")
    out = args.out or str(default_out)
    llm = LLM(
        quantization=args.quantization,
        num_threads=args.threads,
        max_num_seqs=max(16, args.concurrent),
        speculative_config=spec,
        enable_prefix_caching=False,  # every repeat computes its prompt again, for both modes
    )
    tok = llm.get_tokenizer()
    texts = source_texts(max(args.concurrent, 3 * args.repeats))
    rng = random.Random(1)
    cases: dict[str, list[list[list[int]]]] = {}
    wanted = args.cases.split(",")
    if "copy1" in wanted:
        cases["copy x1"] = [[copy_prompt(tok, texts[r], r)] for r in range(args.repeats)]
    if "random1" in wanted:
        cases["random x1"] = [[[rng.randrange(100, 40000) for _ in range(128)]] for _ in range(args.repeats)]
    if "copy16" in wanted:
        n = args.concurrent
        cases[f"copy x{n}"] = [
            [copy_prompt(tok, texts[(r + j) % len(texts)], j) for j in range(n)] for r in range(args.repeats)
        ]
    run_batch(llm, [copy_prompt(tok, texts[0], 0)], 8, True)  # warm-up (kernels, caches)
    rows = []
    results: dict[str, Any] = {
        "machine": machine_info(),
        "spec": spec,
        "quantization": args.quantization,
        "gen": args.gen,
        "cases": {},
    }
    for name, batches in cases.items():
        rates: dict[bool, list[float]] = {False: [], True: []}
        proposed = accepted = 0
        equal = True
        for prompts in batches:
            outs = {}
            for on in (False, True):
                secs, toks, prop, acc = run_batch(llm, prompts, args.gen, on)
                rates[on].append(sum(len(t) for t in toks) / secs)
                outs[on] = toks
                if on:
                    proposed += prop
                    accepted += acc
            equal = equal and outs[False] == outs[True]
        off, on_ = statistics.median(rates[False]), statistics.median(rates[True])
        rate = accepted / proposed if proposed else 0.0
        rows.append([name, off, on_, on_ / off, rate, proposed, "yes" if equal else "NO"])
        results["cases"][name] = dict(
            off_tok_s=rates[False],
            on_tok_s=rates[True],
            ratio=on_ / off,
            acceptance=rate,
            proposed=proposed,
            accepted=accepted,
            greedy_equal=equal,
        )
        print(
            format_table(
                ["case", "off tok/s", "on tok/s", "on/off", "acceptance", "proposed", "same tokens"],
                rows[-1:],
                floatfmt=".2f",
            ),
            flush=True,
        )
    print()
    print(
        format_table(
            ["case", "off tok/s", "on tok/s", "on/off", "acceptance", "proposed", "same tokens"],
            rows,
            floatfmt=".2f",
        )
    )
    results["llama_cpp"] = llama_cpp_prompt_lookup(cases, args) if args.draft is None else "ngram only"
    write_json(out, results)
    return 0 if all(r[-1] == "yes" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
