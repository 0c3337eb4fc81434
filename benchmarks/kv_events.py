"""KV events with nobody listening: what publishing costs the engine's steps.

Two engines on the same weights in one process, side by side: ``off`` (no ``kv_events_config``)
and ``on`` (events published on a ZeroMQ PUB socket that no subscriber ever joins, so every
message is discarded by ZeroMQ, the case the acceptance figure is about). Each round runs the
same workload on both, in alternating order, after a prefix-cache reset; a round's step times
are every ``LLMEngine.step()`` call's wall time. The workload makes many events: prompts of
varied lengths (every full block a ``BlockStored``), a small accelerator pool (evictions:
``BlockRemoved``) over a host tier (demotions and promotions: events on CPU too), and a shared
prefix that half the requests hit. Greedy, EOS ignored, so both engines run the same steps::

    .venv/bin/python benchmarks/kv_events.py                 # the recorded run (docs/benchmarks.md)
    .venv/bin/python benchmarks/kv_events.py --rounds 2      # a quick check

Reported per engine: total step time and mean step time over all rounds, the median of the
per-round on/off ratios and their range, and the events and batches published.
"""

from __future__ import annotations

import argparse
import json
import random
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


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def workload(vocab: int, num_requests: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs: half share a 64-token prefix; prompts 32-192 tokens, 8-16 out."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, vocab) for _ in range(64)]
    out = []
    for i in range(num_requests):
        tail = [rng.randrange(100, vocab) for _ in range(rng.randint(32, 128))]
        out.append(((shared + tail) if i % 2 else tail, rng.randint(8, 16)))
    return out


def run(engine: LLMEngine, requests: list[tuple[list[int], int]], tag: str) -> list[float]:
    """Every step's wall time while ``requests`` run, all submitted at once."""
    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled SmolLM2)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS_DIR / "kv_events.json"))
    args = parser.parse_args()
    set_torch_threads(args.threads)

    common: dict[str, Any] = dict(
        model=args.model,
        num_kv_blocks=args.num_kv_blocks,
        host_kv_cache_bytes=64 * 46 * 1024 * 16,  # ~64 blocks of SmolLM2 in float32
        max_num_seqs=16,
        max_num_batched_tokens=256,
    )
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "topic": "kv@bench",
    }
    engines = {
        "off": LLMEngine(EngineConfig(**common)),
        "on": LLMEngine(EngineConfig(**common, kv_events_config=json.dumps(events))),
    }
    stream = engines["on"].kv_events
    assert stream is not None
    flush_s: list[float] = []
    plain_flush = stream.flush

    def timed_flush() -> None:  # the engine thread's share of publishing, measured
        start = time.perf_counter()
        plain_flush()
        flush_s.append(time.perf_counter() - start)

    stream.flush = timed_flush  # type: ignore[method-assign]
    requests = workload(engines["off"].arch.vocab_size, args.requests, seed=0)
    run(engines["off"], requests[:2], "warm")  # first-step costs (kernels, malloc) off the books
    run(engines["on"], requests[:2], "warm")
    steps: dict[str, list[float]] = {"off": [], "on": []}
    ratios = []
    for r in range(args.rounds):
        order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
        totals = {}
        for name in order:
            engine = engines[name]
            assert engine.reset_prefix_cache()
            engine.publish_stats()
            times = run(engine, requests, f"r{r}")
            steps[name] += times
            totals[name] = sum(times)
        ratios.append(totals["on"] / totals["off"])
        print(f"round {r}: off {totals['off']:.2f} s, on {totals['on']:.2f} s, ratio {ratios[-1]:.3f}")
    counters = engines["on"].stats.kv_events
    assert counters is not None
    rows = [
        [
            name,
            len(steps[name]),
            sum(steps[name]),
            1000 * statistics.mean(steps[name]),
            1000 * statistics.median(steps[name]),
        ]
        for name in ("off", "on")
    ]
    print(format_table(["engine", "steps", "total s", "mean step ms", "median step ms"], rows, ".2f"))
    print(
        f"on/off per round: median {statistics.median(ratios):.3f}, "
        f"range {min(ratios):.3f}-{max(ratios):.3f}; "
        f"{counters.num_events_published} events in {counters.num_batches_published} batches published, "
        f"{counters.num_batches_dropped} batches dropped; flush on the engine thread: mean "
        f"{1e6 * statistics.mean(flush_s):.1f} us, max {1e6 * max(flush_s):.1f} us over {len(flush_s)} calls"
    )
    write_json(
        args.out,
        {
            "machine": machine_info(),
            "args": vars(args),
            "ratios": ratios,
            "steps": {
                name: {"count": len(v), "total_s": sum(v), "mean_s": statistics.mean(v)}
                for name, v in steps.items()
            },
            "events": counters,
            "flush_us": {
                "mean": 1e6 * statistics.mean(flush_s),
                "max": 1e6 * max(flush_s),
                "calls": len(flush_s),
            },
        },
    )
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
