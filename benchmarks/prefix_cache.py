"""Prefix cache and KV tiers: TTFT with a shared system prompt, restoring a prefix, concurrency.

Three parts, each running the engine with the feature on next to the same engine with
it off, in one process, on the same prompts, weights, dtype and thread count::

    .venv/bin/python benchmarks/prefix_cache.py --plot benchmarks/results/prefix_cache.png  # full run
    .venv/bin/python benchmarks/prefix_cache.py --parts ttft --ttft-requests 4             # quick check

Prompts are real text: a few English paragraphs (below) tokenized and repeated to the
exact lengths asked for, plus distinct questions of an exact token length. Every
request decodes greedily with EOS ignored, so each produces exactly ``max_tokens``.

``ttft``: time to first token (TTFT) of requests sharing a system prompt.
    ``--ttft-requests`` (32) requests = one ``--ttft-prefix-len`` (1,024) token system
    prompt + a distinct ``--ttft-question-len`` (32) token question, ``--ttft-max-tokens``
    (8). An earlier, untimed request (its own question) puts the system prompt in the
    cache; the off engine runs it too. TTFT of a request = ``first_token_time -
    arrival_time`` from its ``RequestOutput.metrics``: from ``add_request`` to the end
    of the step that sampled its first token. Two variants:

    * ``sequential``: each request is submitted alone and runs to completion before the
      next; the on and off engines take turns request by request (so a change in machine
      load hits both). This is the acceptance figure: cache on, a request computes its
      question; off, it computes system prompt + question, so the ideal speed-up is
      ``(prefix + question) / question`` = 33x at the defaults; the bar is 0.6 of it.
      A third request per round, the question alone on the cache-off engine (the
      ``floor``), shows what this CPU charges for a 32-token step without any prefix:
      ``achievable_speedup`` = off / floor.
    * ``batch``: all requests submitted at once (other questions than ``sequential``, so
      nothing but the system prompt is cached); TTFT then includes queueing behind the
      other prefills. Reported with the same ideal for comparison; no bar.

``restore``: bringing back a ``--restore-prefix-len`` (2,048) token prefix.
    Three engines with the same accelerator pool, sized to exactly what one request
    needs (prefix + 1 prompt token + 1 output token, ``--restore-pool-slack`` more):
    ``host`` (prefix cache + a host tier), ``disk`` (prefix cache + a disk tier, host
    tier of 0 bytes so evictions go straight to disk) and ``recompute`` (cache off). Two
    prefixes P1 and P2 are computed on each tiered engine; each request fills the whole
    pool, so computing one evicts every block of the other down a tier. The timed
    request is the evicted prefix + one new token: its whole prefix must come back
    (``num_cached_tokens`` = the prefix, and the tier's ``promotions`` counter grows by
    the prefix's block count; both are checked and recorded), and bringing it back
    evicts the other prefix in turn, so the requests alternate P1, P2, ... On disk,
    writes in flight are flushed before the timed request; ``disk_warm`` reads records
    the page cache still holds, ``disk_cold`` first fsyncs the slot files and drops
    them from the page cache (``posix_fadvise(DONTNEED)``; residency before and after
    from ``fincore`` when present). The recompute engine's TTFT is the same prompt
    computed from scratch. Figures: TTFT of each, and recompute / restore speed-up
    (bars: host >= 10x, disk >= 3x, judged on ``disk_cold``). ``schedule_s`` is the
    scheduler's time in the request's first step, which holds the promotion.

``concurrency``: the most sequences held at a fixed accelerator budget.
    ``--conc-requests`` (64) requests = one ``--conc-prefix-len`` (512) token shared
    prefix + a distinct ``--conc-question-len`` (32) token question, ``--conc-max-tokens``
    (32), submitted at once to engines with ``--conc-num-kv-blocks`` (256) KV blocks:
    prefix cache + host tier (+ disk tier) on, vs everything off. The prefix is cached by
    an earlier untimed request, as in ``ttft``. Reports the largest number of running
    sequences over the engine steps (``len(engine.scheduler.running)`` after each step),
    the mean, preemptions, and throughput (output and prompt+output tokens/s).
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    format_table,
    machine_info,
    set_torch_threads,
    stopwatch,
    token_agreement,
    write_json,
)

ALL_PARTS = ("ttft", "restore", "concurrency")
TTFT_BAR = 0.6  # fraction of the ideal (prefix + question) / question speed-up, sequential variant
RESTORE_BAR = {"host": 10.0, "disk": 3.0}  # recompute TTFT / restore TTFT
DEFAULT_OUT = RESULTS_DIR / "prefix_cache.json"

# Original prose, so prompts are natural token sequences rather than random ids.
TEXT = (
    "The lighthouse at the end of the northern breakwater was built in 1871 from granite "
    "quarried on the island itself. Its keepers kept a log of every ship that passed, the "
    "state of the sea at dawn and dusk, and the hours the lamp burned. In winter the spray "
    "froze on the gallery rail, and the keepers chipped it away with wooden mallets so the "
    "weight would not bend the iron.\n\n"
    "When the lamp was converted from oil to electricity in 1923, the keepers complained "
    "that the new light was colder and harsher, although ships could see it four miles "
    "further out. A small generator house was added beside the tower, and a cable was laid "
    "across the harbour floor so that the town could send power when the generator failed.\n\n"
    "Fishing boats left the harbour before sunrise and returned in the early afternoon, "
    "when the market opened on the quay. Prices were chalked on a board outside the harbour "
    "master's office: cod, haddock, mackerel in summer, herring when the shoals came close "
    "to shore. Children who helped to unload the catch were paid in coins and in fish.\n\n"
    "The last keeper left in 1987, when the light was automated and a radio beacon was "
    "installed on the roof of the generator house. The tower is now a museum. Visitors climb "
    "the one hundred and twelve steps to the lamp room, read the old logs behind glass, and "
    "look out over the water where the breakwater disappears under the waves at high tide.\n\n"
)
QUESTIONS = (
    "In which year was the lighthouse built, and what stone was used for the tower?",
    "Why did the keepers chip the ice from the gallery rail in winter?",
    "What did the keepers think of the electric light compared to the oil lamp?",
    "How did the town send power to the lighthouse when the generator failed?",
    "When did the fishing boats leave the harbour and when did they come back?",
    "Which fish were sold at the market on the quay, and in which seasons?",
    "How were the children who helped to unload the catch paid for their work?",
    "What replaced the last keeper when the lighthouse was automated in 1987?",
)


# -- prompts ------------------------------------------------------------------------------
class PromptMaker:
    """Exact-length token prompts from ``TEXT`` and ``QUESTIONS`` (no special tokens)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.text_ids: list[int] = list(tokenizer.encode(TEXT, add_special_tokens=False))

    def document(self, num_tokens: int, title: str) -> list[int]:
        """``title`` followed by ``TEXT`` repeated, cut at exactly ``num_tokens`` tokens."""
        ids = list(self.tok.encode(title + "\n\n", add_special_tokens=False))
        while len(ids) < num_tokens:
            ids.extend(self.text_ids)
        return ids[:num_tokens]

    def question(self, index: int, num_tokens: int) -> list[int]:
        """A question numbered ``index`` (distinct from its first tokens on), exactly ``num_tokens`` long."""
        text = f"\n\nQuestion {index}: {QUESTIONS[index % len(QUESTIONS)]}"
        ids = list(self.tok.encode(text, add_special_tokens=False))
        filler = list(
            self.tok.encode(" Answer in one short sentence, quoting the text.", add_special_tokens=False)
        )
        while len(ids) < num_tokens:
            ids.extend(filler)
        return ids[:num_tokens]


# -- engines and requests -----------------------------------------------------------------
def make_llm(args: argparse.Namespace, **engine_kwargs: Any) -> Any:
    from loraplex import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_threads=args.threads,
        attention_backend=args.attention_backend,
        linear_backend=args.linear_backend,
        seed=0,
        **engine_kwargs,
    )


def greedy(max_tokens: int) -> Any:
    from loraplex import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def warm_up(llm: Any) -> None:
    """Short untimed batches (prefills of several lengths, decodes, a prefix hit when caching
    is on): kernels built, allocator and code paths touched before anything is timed."""
    head = [100 + i for i in range(2 * llm.llm_engine.config.block_size)]
    for tails in ([[7], [8, 9, 10], [11] * 20], [[12], [13, 14]]):
        llm.generate([head + t for t in tails], greedy(2), use_tqdm=False)


def ttft_s(out: Any) -> float:
    return float(out.metrics["first_token_time"] - out.metrics["arrival_time"])


def run_alone(engine: Any, request_id: str, prompt: list[int], params: Any) -> Any:
    """Submit one request on an idle engine and step it to completion; its final output."""
    if engine.has_unfinished_requests():
        raise RuntimeError(f"engine busy before request {request_id}: the timing would include other work")
    engine.add_request(request_id, prompt, params)
    while True:
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"engine idle but request {request_id} did not finish")
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                if out.error:
                    raise RuntimeError(f"request {request_id} failed: {out.error}")
                return out


def run_batch(
    engine: Any,
    tag: str,
    prompts: list[list[int]],
    params: Any,
    on_step: Callable[[], None] | None = None,
) -> list[Any]:
    """Submit every prompt at once and step until all finish; outputs in prompt order."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    done: dict[str, Any] = {}
    while len(done) < len(ids):
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"engine idle with {len(ids) - len(done)} of batch {tag} unfinished")
        for out in engine.step():
            if out.finished:
                if out.error:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                done[out.request_id] = out
        if on_step is not None:
            on_step()
    return [done[i] for i in ids]


def tier_counters(engine: Any) -> dict[str, dict[str, int]]:
    """Per-tier counters now (``{}`` without tiers)."""
    if engine.kv.tiers is None:
        return {}
    return {m.tier: asdict(m) for m in engine.kv.tiers.metrics()}


def counter_delta(
    after: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]], name: str
) -> dict[str, int]:
    return {t: int(after[t][name]) - int(before.get(t, {}).get(name, 0)) for t in after}


def describe(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
        "n": len(values),
    }


@contextmanager
def schedule_timer(engine: Any) -> Iterator[list[float]]:
    """Record how long each ``scheduler.schedule()`` call takes (promotions run inside it)."""
    times: list[float] = []
    original = engine.scheduler.schedule

    def timed() -> Any:
        start = time.perf_counter()
        try:
            return original()
        finally:
            times.append(time.perf_counter() - start)

    engine.scheduler.schedule = timed
    try:
        yield times
    finally:
        engine.scheduler.schedule = original


def load_now() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def close(*llms: Any) -> None:
    for llm in llms:
        llm.shutdown()
    gc.collect()


# -- part 1: TTFT with a shared system prompt ---------------------------------------------
def part_ttft(args: argparse.Namespace, maker: PromptMaker, progress: bool) -> dict[str, Any]:
    from tqdm.auto import tqdm

    n, plen, qlen, bs = args.ttft_requests, args.ttft_prefix_len, args.ttft_question_len, args.block_size
    system = maker.document(plen, "System: you answer questions about the passage below.")
    seq_prompts = [system + maker.question(1 + i, qlen) for i in range(n)]
    batch_prompts = [system + maker.question(1 + n + i, qlen) for i in range(n)]
    warm_prompt = system + maker.question(0, qlen)
    params = greedy(args.ttft_max_tokens)
    per_request_blocks = math.ceil((plen + qlen + args.ttft_max_tokens) / bs)
    num_kv_blocks = n * per_request_blocks + math.ceil(plen / bs) + 8  # the whole batch fits, even uncached
    engine_args = {
        "num_kv_blocks": num_kv_blocks,
        "max_num_seqs": max(n, 1),
        "max_num_batched_tokens": max(args.ttft_max_batched_tokens, n),
    }
    load_start = load_now()
    print(f"engines: {engine_args}", flush=True)
    llms = {"on": make_llm(args, enable_prefix_caching=True, **engine_args)}
    llms["off"] = make_llm(args, enable_prefix_caching=False, **engine_args)
    for name, llm in llms.items():
        warm_up(llm)
        out = run_alone(llm.llm_engine, f"ttft-warm-{name}", warm_prompt, params)
        print(f"  {name}: system-prompt request (untimed) cached {out.num_cached_tokens} tokens", flush=True)

    records: dict[str, dict[str, list[Any]]] = {
        f"{v}_{s}": {"ttft_s": [], "num_cached_tokens": [], "outputs": []}
        for v in ("sequential", "batch")
        for s in ("on", "off")
    }

    def record(key: str, out: Any) -> None:
        records[key]["ttft_s"].append(ttft_s(out))
        records[key]["num_cached_tokens"].append(out.num_cached_tokens)
        records[key]["outputs"].append(list(out.outputs[0].token_ids))

    # The floor: the question alone (no system prompt) on the cache-off engine, what a
    # request that computes only its question costs on this CPU without attending to a prefix.
    records["sequential_floor"] = {"ttft_s": [], "num_cached_tokens": [], "outputs": []}
    jobs = ("on", "off", "floor")
    bar = tqdm(total=n, desc="ttft sequential", unit="req", disable=not progress)
    for i, prompt in enumerate(seq_prompts):
        for k in range(len(jobs)):
            job = jobs[(i + k) % len(jobs)]  # rotate: none always runs right after another
            engine = llms["on" if job == "on" else "off"].llm_engine
            job_prompt = prompt[plen:] if job == "floor" else prompt
            record(f"sequential_{job}", run_alone(engine, f"ttft-seq-{job}-{i}", job_prompt, params))
        bar.update(1)
        on_s, off_s = records["sequential_on"]["ttft_s"], records["sequential_off"]["ttft_s"]
        bar.set_postfix(
            on_ms=f"{1e3 * statistics.fmean(on_s):.0f}", off_ms=f"{1e3 * statistics.fmean(off_s):.0f}"
        )
    bar.close()
    for name in ("on", "off"):
        print(f"  batch, cache {name}: {n} requests at once", flush=True)
        with stopwatch() as t:
            outs = run_batch(llms[name].llm_engine, f"ttft-batch-{name}", batch_prompts, params)
        for out in outs:
            record(f"batch_{name}", out)
        records[f"batch_{name}"]["seconds"] = [t["seconds"]]
    close(*llms.values())
    del llms

    ideal = (plen + qlen) / qlen
    expected_hit = min(plen // bs, (plen + qlen - 1) // bs) * bs
    variants: dict[str, Any] = {}
    for variant in ("sequential", "batch"):
        on, off = records[f"{variant}_on"], records[f"{variant}_off"]
        speedup = statistics.fmean(off["ttft_s"]) / statistics.fmean(on["ttft_s"])
        variants[variant] = {
            "on": {"ttft_s": describe(on["ttft_s"]), "num_cached_tokens": on["num_cached_tokens"]},
            "off": {"ttft_s": describe(off["ttft_s"]), "num_cached_tokens": off["num_cached_tokens"]},
            "speedup": speedup,
            "fraction_of_ideal": speedup / ideal,
            "hits_verified": all(c == expected_hit for c in on["num_cached_tokens"])
            and all(c == 0 for c in off["num_cached_tokens"]),
            "greedy_agreement_on_vs_off": token_agreement(off["outputs"], on["outputs"]),
        }
        if "seconds" in on:
            variants[variant]["on"]["batch_seconds"] = on["seconds"][0]
            variants[variant]["off"]["batch_seconds"] = off["seconds"][0]
    seq = variants["sequential"]
    floor_ttft = records["sequential_floor"]["ttft_s"]
    seq["floor"] = {"ttft_s": describe(floor_ttft), "prompt_tokens": qlen}
    seq["achievable_speedup"] = seq["off"]["ttft_s"]["mean"] / statistics.fmean(floor_ttft)
    seq["fraction_of_achievable"] = seq["speedup"] / seq["achievable_speedup"]
    fraction = seq["fraction_of_ideal"]
    return {
        "workload": {
            "num_requests": n,
            "system_prompt_tokens": plen,
            "question_tokens": qlen,
            "max_tokens": args.ttft_max_tokens,
            "expected_cached_tokens": expected_hit,
            "engine_args": engine_args,
        },
        "definition": "TTFT = RequestOutput.metrics first_token_time - arrival_time (add_request to the end "
        "of the step that sampled the first token); speedup = mean TTFT off / mean TTFT on; sequential "
        "floor = TTFT of the question alone (no system prompt, cache off); achievable_speedup = mean TTFT "
        "off / floor",
        "ideal_speedup": ideal,
        "variants": variants,
        "bar": {
            "variant": "sequential",
            "fraction_of_ideal": TTFT_BAR,
            "achieved": fraction,
            "pass": fraction >= TTFT_BAR,
        },
        "loadavg_start": load_start,
        "loadavg_end": load_now(),
    }


# -- part 2: restoring a prefix from host and from disk -----------------------------------
def slot_files(path: Path) -> list[Path]:
    return sorted(path.glob("slot_*.kvb"))


def page_cache_resident_bytes(paths: list[Path]) -> int | None:
    """Bytes of ``paths`` in the page cache (util-linux ``fincore``); None if unavailable."""
    if not paths or shutil.which("fincore") is None:
        return None
    try:
        res = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths)],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(int(line.split()[0]) for line in res.stdout.splitlines() if line.strip())


def drop_page_cache(paths: list[Path]) -> None:
    """fsync each file (DONTNEED only drops clean pages), then drop it from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class TieredRestore:
    """One tiered engine holding prefixes P1 and P2; each timed request brings back the evicted one."""

    def __init__(self, llm: Any, prefixes: list[list[int]], disk_dir: Path | None) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.prefixes = prefixes
        self.disk_dir = disk_dir
        self.next = 0  # the prefix that is not on the device now
        self.num_requests = 0

    def compute_both(self, tail: int) -> None:
        """Compute P1 then P2 (untimed): P2 evicts P1 down a tier."""
        for k, prefix in enumerate(self.prefixes):
            run_alone(self.engine, f"restore-setup-{id(self)}-{k}", [*prefix, tail], greedy(1))
        self.next = 0

    def timed(self, tail: int, variant: str) -> dict[str, Any]:
        """Re-request the evicted prefix + ``tail``; TTFT, where its cached tokens came from."""
        if self.engine.kv.tiers is not None:
            self.engine.kv.tiers.flush()  # reads must come from the tier, not a write still in flight
        page_cache: dict[str, int | None] = {}
        if variant == "disk_cold" and self.disk_dir is not None:
            files = slot_files(self.disk_dir)
            page_cache["before_drop"] = page_cache_resident_bytes(files)
            drop_page_cache(files)
            page_cache["after_drop"] = page_cache_resident_bytes(files)
        elif variant == "disk_warm" and self.disk_dir is not None:
            page_cache["resident"] = page_cache_resident_bytes(slot_files(self.disk_dir))
        prefix = self.prefixes[self.next]
        before = tier_counters(self.engine)
        with schedule_timer(self.engine) as sched:
            out = run_alone(self.engine, f"restore-{variant}-{self.num_requests}", [*prefix, tail], greedy(1))
        after = tier_counters(self.engine)
        self.num_requests += 1
        self.next = 1 - self.next
        return {
            "ttft_s": ttft_s(out),
            "schedule_s": sched[0] if sched else None,
            "num_cached_tokens": out.num_cached_tokens,
            "promotions": counter_delta(after, before, "promotions"),
            "demotions": counter_delta(after, before, "demotions"),
            "bytes_out": counter_delta(after, before, "bytes_out"),
            "page_cache_bytes": page_cache,
        }


def part_restore(args: argparse.Namespace, maker: PromptMaker, progress: bool) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from loraplex.storage.kv.tiers import block_codec

    plen, bs = args.restore_prefix_len, args.block_size
    if plen % bs:
        raise SystemExit(f"--restore-prefix-len ({plen}) must be a multiple of --block-size ({bs})")
    num_prefix_blocks = plen // bs
    prefixes = [maker.document(plen, f"Document {name}.") for name in ("A", "B")]
    # Distinct last prompt tokens: the prefix is what repeats, the final token is always computed.
    tails = list(
        dict.fromkeys(maker.tok.encode(" 0 1 2 3 4 5 6 7 8 9 a b c d e f g h", add_special_tokens=False))
    )
    # Exactly one request fits: computing one prefix evicts every block of the other.
    num_kv_blocks = math.ceil((plen + 2) / bs) + args.restore_pool_slack
    engine_args = {"num_kv_blocks": num_kv_blocks, "max_num_seqs": 4, "max_num_batched_tokens": plen + 64}
    print(f"engines: {engine_args}", flush=True)
    load_start = load_now()
    recompute = make_llm(args, enable_prefix_caching=False, **engine_args)
    block_bytes = recompute.llm_engine.info.kv_bytes_per_block
    layout = recompute.llm_engine.runner.kv_cache.layout
    tier_blocks = 2 * num_prefix_blocks + 16  # both prefixes and their partial tail blocks, with room
    host = make_llm(
        args, enable_prefix_caching=True, host_kv_cache_bytes=tier_blocks * block_bytes, **engine_args
    )
    disk_root = Path(tempfile.mkdtemp(prefix="loraplex-prefix-bench-", dir=args.restore_disk_dir))
    disk = make_llm(
        args,
        enable_prefix_caching=True,
        host_kv_cache_bytes=0,
        disk_kv_path=str(disk_root),
        disk_kv_cache_bytes=tier_blocks * block_codec.record_bytes(layout),
        **engine_args,
    )
    try:
        for llm in (recompute, host, disk):
            warm_up(llm)
        runners = {
            "host": TieredRestore(host, prefixes, None),
            "disk": TieredRestore(disk, prefixes, disk_root),
        }
        print(f"  computing two {plen}-token prefixes on the host and disk engines (untimed)", flush=True)
        for runner in runners.values():
            runner.compute_both(tails[0])
        variants = ["host", "disk_warm", "disk_cold", "recompute"]
        if args.restore_no_cold:
            variants.remove("disk_cold")
        results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        bar = tqdm(total=args.restore_reps * len(variants), desc="restore", unit="req", disable=not progress)
        for rep in range(args.restore_reps):
            tail = tails[1 + rep % (len(tails) - 1)]
            for k in range(len(variants)):
                variant = variants[(rep + k) % len(variants)]  # rotate the order between reps
                if variant == "recompute":
                    out = run_alone(
                        recompute.llm_engine, f"restore-recompute-{rep}", [*prefixes[0], tail], greedy(1)
                    )
                    results[variant].append(
                        {"ttft_s": ttft_s(out), "num_cached_tokens": out.num_cached_tokens}
                    )
                else:
                    results[variant].append(runners[variant.split("_")[0]].timed(tail, variant))
                bar.update(1)
        bar.close()
        tier_metrics = {name: tier_counters(r.engine) for name, r in runners.items()}
        prefix_stats = {
            name: asdict(r.engine.kv.block_manager.prefix_cache_stats()) for name, r in runners.items()
        }
    finally:
        close(recompute, host, disk)
        shutil.rmtree(disk_root, ignore_errors=True)

    def verified(variant: str, rec: dict[str, Any]) -> bool:
        if variant == "recompute":
            return bool(rec["num_cached_tokens"] == 0)
        tier = "host" if variant == "host" else "disk"
        other = "disk" if tier == "host" else "host"
        return bool(
            rec["num_cached_tokens"] == plen
            and rec["promotions"].get(tier) == num_prefix_blocks
            and rec["promotions"].get(other, 0) == 0
        )

    recompute_mean = statistics.fmean(r["ttft_s"] for r in results["recompute"])
    summary: dict[str, Any] = {}
    for variant, recs in results.items():
        ttfts = [r["ttft_s"] for r in recs]
        entry: dict[str, Any] = {
            "ttft_s": describe(ttfts),
            "runs": recs,
            "verified": all(verified(variant, r) for r in recs),
        }
        if variant != "recompute":
            entry["speedup_vs_recompute"] = recompute_mean / statistics.fmean(ttfts)
            sched = [r["schedule_s"] for r in recs if r["schedule_s"] is not None]
            if sched:
                entry["schedule_s"] = describe(sched)
        summary[variant] = entry
    disk_variant = "disk_cold" if "disk_cold" in summary else "disk_warm"
    bars = {
        "host": {
            "variant": "host",
            "bar": RESTORE_BAR["host"],
            "achieved": summary["host"]["speedup_vs_recompute"],
        },
        "disk": {
            "variant": disk_variant,
            "bar": RESTORE_BAR["disk"],
            "achieved": summary[disk_variant]["speedup_vs_recompute"],
        },
    }
    for b in bars.values():
        b["pass"] = b["achieved"] >= b["bar"]
    return {
        "workload": {
            "prefix_tokens": plen,
            "prefix_blocks": num_prefix_blocks,
            "prompt_tokens": plen + 1,
            "max_tokens": 1,
            "reps": args.restore_reps,
            "engine_args": engine_args,
            "tier_blocks": tier_blocks,
            "kv_bytes_per_block": block_bytes,
            "disk_record_bytes": block_codec.record_bytes(layout),
            "disk_dir_parent": args.restore_disk_dir or tempfile.gettempdir(),
        },
        "variants": summary,
        "bars": bars,
        "tier_metrics_end": tier_metrics,
        "prefix_cache_stats_end": prefix_stats,
        "loadavg_start": load_start,
        "loadavg_end": load_now(),
    }


# -- part 3: concurrency at a fixed accelerator budget -------------------------------------
def sample_running(scheduler: Any, running: list[int]) -> None:
    """After a step: how many sequences the scheduler holds running."""
    running.append(len(scheduler.running))


def part_concurrency(args: argparse.Namespace, maker: PromptMaker, progress: bool) -> dict[str, Any]:
    n, plen, qlen, mt = args.conc_requests, args.conc_prefix_len, args.conc_question_len, args.conc_max_tokens
    shared = maker.document(plen, "Shared context: a short history of a harbour town.")
    prompts = [shared + maker.question(1 + i, qlen) for i in range(n)]
    warm_prompt = shared + maker.question(0, qlen)
    params = greedy(mt)
    engine_args = {
        "num_kv_blocks": args.conc_num_kv_blocks,
        "max_num_seqs": args.conc_max_num_seqs,
        "max_num_batched_tokens": max(args.conc_max_batched_tokens, args.conc_max_num_seqs),
    }
    print(f"engines: {engine_args}", flush=True)
    load_start = load_now()
    disk_root = Path(tempfile.mkdtemp(prefix="loraplex-prefix-bench-", dir=args.restore_disk_dir))
    configs: dict[str, dict[str, Any]] = {
        "on": {
            "enable_prefix_caching": True,
            "host_kv_cache_bytes": int(args.conc_host_kv_mib * 2**20),
            "disk_kv_path": str(disk_root) if args.conc_disk_kv_mib > 0 else None,
            "disk_kv_cache_bytes": int(args.conc_disk_kv_mib * 2**20),
        },
        "off": {"enable_prefix_caching": False},
    }
    runs: dict[str, Any] = {}
    try:
        for name, cfg in configs.items():
            llm = make_llm(args, **cfg, **engine_args)
            engine = llm.llm_engine
            warm_up(llm)
            run_alone(engine, f"conc-warm-{name}", warm_prompt, params)
            running: list[int] = []
            steps0, pre0 = engine.num_steps, engine.scheduler.num_preemptions
            swaps0 = (engine.scheduler.num_swapped_out, engine.scheduler.num_swapped_in)
            batched0 = engine.num_batched_tokens
            tiers0 = tier_counters(engine)
            print(f"  cache {name}: {n} requests at once, load {load_now()}", flush=True)
            with stopwatch() as t:
                outs = run_batch(
                    engine,
                    f"conc-{name}",
                    prompts,
                    params,
                    functools.partial(sample_running, engine.scheduler, running),
                )
            out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            prompt_tokens = sum(len(p) for p in prompts)
            tiers1 = tier_counters(engine)
            runs[name] = {
                "seconds": t["seconds"],
                "cpu_seconds": t["cpu_seconds"],
                "max_running": max(running, default=0),
                "mean_running": statistics.fmean(running) if running else 0.0,
                "engine_steps": engine.num_steps - steps0,
                "preemptions": engine.scheduler.num_preemptions - pre0,
                # preempted sequences whose partial tail was swapped out / came back (preemption_mode auto)
                "swapped_out": engine.scheduler.num_swapped_out - swaps0[0],
                "swapped_in": engine.scheduler.num_swapped_in - swaps0[1],
                # tokens run through the model: prompt tokens not served from cache, recomputation, decodes
                "batched_tokens": engine.num_batched_tokens - batched0,
                "output_tokens": out_tokens,
                "prompt_tokens": prompt_tokens,
                "output_tok_s": out_tokens / t["seconds"],
                "total_tok_s": (out_tokens + prompt_tokens) / t["seconds"],
                "num_cached_tokens_total": sum(o.num_cached_tokens for o in outs),
                "num_cached_tokens_min": min(o.num_cached_tokens for o in outs),
                "ttft_s": describe([ttft_s(o) for o in outs]),
                "output_token_counts_ok": all(len(o.outputs[0].token_ids) == mt for o in outs),
                "tier_promotions": counter_delta(tiers1, tiers0, "promotions") if tiers1 else {},
                "tier_demotions": counter_delta(tiers1, tiers0, "demotions") if tiers1 else {},
                "running_per_step": running,
            }
            close(llm)
            del llm, engine
    finally:
        shutil.rmtree(disk_root, ignore_errors=True)
    on, off = runs["on"], runs["off"]
    per_request_blocks = math.ceil((plen + qlen + mt) / args.block_size)
    return {
        "workload": {
            "num_requests": n,
            "shared_prefix_tokens": plen,
            "question_tokens": qlen,
            "max_tokens": mt,
            "engine_args": engine_args,
            "kv_budget_tokens": args.conc_num_kv_blocks * args.block_size,
            "blocks_per_request_unshared": per_request_blocks,
            "tiers_on": {k: v for k, v in configs["on"].items() if k != "enable_prefix_caching"},
        },
        "runs": runs,
        "ratios": {
            "max_running": on["max_running"] / off["max_running"] if off["max_running"] else float("inf"),
            "mean_running": on["mean_running"] / off["mean_running"] if off["mean_running"] else float("inf"),
            "output_tok_s": on["output_tok_s"] / off["output_tok_s"],
            "total_tok_s": on["total_tok_s"] / off["total_tok_s"],
        },
        "loadavg_start": load_start,
        "loadavg_end": load_now(),
    }


# -- reporting ------------------------------------------------------------------------------
def print_summary(report: dict[str, Any]) -> None:
    parts = report["parts"]
    if "ttft" in parts:
        p = parts["ttft"]
        rows = []
        for variant, v in p["variants"].items():
            rows.append(
                [
                    variant,
                    f"{1e3 * v['on']['ttft_s']['mean']:.0f}",
                    f"{1e3 * v['off']['ttft_s']['mean']:.0f}",
                    f"{v['speedup']:.1f}x",
                    f"{v['fraction_of_ideal']:.2f}",
                    v["hits_verified"],
                ]
            )
        print(f"\nTTFT, shared system prompt (ideal {p['ideal_speedup']:.1f}x):")
        print(format_table(["variant", "on ms", "off ms", "speed-up", "of ideal", "hits ok"], rows))
        seq = p["variants"]["sequential"]
        print(
            f"floor (question alone, no prefix): {1e3 * seq['floor']['ttft_s']['mean']:.0f} ms -> achievable "
            f"{seq['achievable_speedup']:.1f}x; cache on reaches {seq['fraction_of_achievable']:.2f} of it"
        )
        b = p["bar"]
        print(f"bar (sequential >= {b['fraction_of_ideal']} of ideal): {'PASS' if b['pass'] else 'FAIL'}")
    if "restore" in parts:
        p = parts["restore"]
        rows = []
        for variant, v in p["variants"].items():
            sp = v.get("speedup_vs_recompute")
            rows.append(
                [
                    variant,
                    f"{1e3 * v['ttft_s']['mean']:.0f}",
                    f"{1e3 * v['ttft_s']['median']:.0f}",
                    "" if sp is None else f"{sp:.1f}x",
                    v["verified"],
                ]
            )
        print(f"\nrestoring a {p['workload']['prefix_tokens']}-token prefix ({p['workload']['reps']} reps):")
        print(format_table(["variant", "mean ms", "median ms", "vs recompute", "verified"], rows))
        for tier, b in p["bars"].items():
            print(
                f"bar {tier} ({b['variant']}) >= {b['bar']}x: {b['achieved']:.1f}x "
                f"{'PASS' if b['pass'] else 'FAIL'}"
            )
    if "concurrency" in parts:
        p = parts["concurrency"]
        rows = [
            [name, r["max_running"], f"{r['mean_running']:.1f}", r["preemptions"], f"{r['seconds']:.1f}",
             f"{r['output_tok_s']:.1f}", f"{r['total_tok_s']:.1f}"]
            for name, r in p["runs"].items()
        ]  # fmt: skip
        print(f"\nconcurrency at {p['workload']['engine_args']['num_kv_blocks']} KV blocks:")
        print(
            format_table(
                ["cache+tiers", "max running", "mean", "preempt", "s", "out tok/s", "total tok/s"], rows
            )
        )
        r = p["ratios"]
        print(f"on / off: max running {r['max_running']:.2f}x, total tok/s {r['total_tok_s']:.2f}x")


def make_plot(path: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in ALL_PARTS if p in report["parts"]]
    fig, axes = plt.subplots(1, len(parts), figsize=(5.5 * len(parts), 4.6), squeeze=False)
    on_color, off_color = "#2b7bba", "#999999"
    for ax, part in zip(axes[0], parts, strict=True):
        p = report["parts"][part]
        if part == "ttft":
            names = list(p["variants"])
            x = range(len(names))
            off = [1e3 * p["variants"][v]["off"]["ttft_s"]["mean"] for v in names]
            on = [1e3 * p["variants"][v]["on"]["ttft_s"]["mean"] for v in names]
            ax.bar([i - 0.2 for i in x], off, 0.4, color=off_color, label="cache off")
            ax.bar([i + 0.2 for i in x], on, 0.4, color=on_color, label="cache on")
            for i, v in enumerate(names):
                d = p["variants"][v]
                ax.annotate(
                    f"{d['speedup']:.1f}x\n{d['fraction_of_ideal']:.2f} of ideal",
                    (i, off[i]),
                    ha="center",
                    va="bottom",
                    fontsize=9,
                )
            if "sequential" in names and "floor" in p["variants"]["sequential"]:
                # What the bar asks of the cached request next to what this CPU charges for
                # the question alone: a bar line below the floor cannot be met by any cache.
                i = names.index("sequential")
                seq = p["variants"]["sequential"]
                floor_ms = 1e3 * seq["floor"]["ttft_s"]["mean"]
                bar_ms = off[i] / (TTFT_BAR * p["ideal_speedup"])
                ax.hlines(
                    floor_ms,
                    i - 0.4,
                    i + 0.4,
                    colors="black",
                    linestyles="dashed",
                    label=f"floor: question alone ({floor_ms:.0f} ms)",
                )
                ax.hlines(
                    bar_ms,
                    i - 0.4,
                    i + 0.4,
                    colors="#d62728",
                    linestyles="dotted",
                    label=f"on TTFT the bar needs ({bar_ms:.0f} ms)",
                )
            ax.set_xticks(list(x), names)
            ax.set_yscale("log")
            ax.set_ylabel("mean TTFT (ms, log)")
            w = p["workload"]
            ax.set_title(
                f"TTFT: {w['num_requests']} req, {w['system_prompt_tokens']}-tok system prompt\n"
                f"+ {w['question_tokens']}-tok questions (ideal {p['ideal_speedup']:.0f}x)",
                fontsize=10,
            )
            ax.set_ylim(top=max(off) * 40)  # room above the bars for the legend
            ax.legend(loc="upper left", fontsize=7)
        elif part == "restore":
            names = list(p["variants"])
            vals = [1e3 * p["variants"][v]["ttft_s"]["mean"] for v in names]
            colors = [off_color if v == "recompute" else on_color for v in names]
            bars = ax.bar(names, vals, color=colors)
            labels = [
                "" if v == "recompute" else f"{p['variants'][v]['speedup_vs_recompute']:.1f}x" for v in names
            ]
            ax.bar_label(bars, labels=labels, fontsize=9)
            ax.set_yscale("log")
            ax.set_ylabel("mean TTFT of the re-request (ms, log)")
            ax.set_title(
                f"Restore a {p['workload']['prefix_tokens']}-token prefix vs recompute\n"
                f"(bars: host >= {RESTORE_BAR['host']:.0f}x, disk >= {RESTORE_BAR['disk']:.0f}x)",
                fontsize=10,
            )
            ax.margins(y=0.2)
        else:
            names = ["off", "on"]
            vals = [p["runs"][v]["max_running"] for v in names]
            bars = ax.bar(["everything off", "prefix cache + tiers"], vals, color=[off_color, on_color])
            runs = p["runs"]
            labels = [f"{runs[v]['max_running']} seqs\n{runs[v]['total_tok_s']:.0f} tok/s" for v in names]
            ax.bar_label(bars, labels=labels, fontsize=9)
            ax.set_ylabel("most sequences running at once")
            w = p["workload"]
            r = p["ratios"]
            ax.set_title(
                f"{w['engine_args']['num_kv_blocks']} KV blocks, {w['num_requests']} req sharing "
                f"{w['shared_prefix_tokens']} tokens\non/off: {r['max_running']:.1f}x running, "
                f"{r['total_tok_s']:.1f}x tok/s",
                fontsize=10,
            )
            ax.margins(y=0.2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- arguments and main -------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--model", default=None, help="HF model directory (default: the bundled SmolLM2-135M-Instruct)"
    )
    p.add_argument("--parts", default=",".join(ALL_PARTS), help=f"comma list out of {','.join(ALL_PARTS)}")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads for every engine")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu"])
    p.add_argument("--linear-backend", default="auto", choices=["auto", "torch", "cpu"])
    p.add_argument("--block-size", type=int, default=16)
    g = p.add_argument_group("ttft: requests sharing a system prompt")
    g.add_argument("--ttft-requests", type=int, default=32)
    g.add_argument("--ttft-prefix-len", type=int, default=1024, help="system prompt tokens")
    g.add_argument("--ttft-question-len", type=int, default=32, help="tokens of each distinct question")
    g.add_argument("--ttft-max-tokens", type=int, default=8)
    g.add_argument("--ttft-max-batched-tokens", type=int, default=2048, help="engine per-step token budget")
    g = p.add_argument_group("restore: a prefix back from host / disk vs recompute")
    g.add_argument(
        "--restore-prefix-len", type=int, default=2048, help="prefix tokens (a multiple of the block size)"
    )
    g.add_argument("--restore-reps", type=int, default=3, help="timed requests per variant")
    g.add_argument(
        "--restore-pool-slack", type=int, default=0, help="KV blocks beyond what one request needs"
    )
    g.add_argument("--restore-disk-dir", default=None, help="parent of the temporary disk-tier directories")
    g.add_argument(
        "--restore-no-cold", action="store_true", help="skip the cold (page cache dropped) disk variant"
    )
    g = p.add_argument_group("concurrency: requests sharing a prefix at a fixed KV budget")
    g.add_argument("--conc-requests", type=int, default=64)
    g.add_argument("--conc-prefix-len", type=int, default=512)
    g.add_argument("--conc-question-len", type=int, default=32)
    g.add_argument("--conc-max-tokens", type=int, default=32)
    g.add_argument("--conc-num-kv-blocks", type=int, default=256, help="the accelerator KV budget, in blocks")
    g.add_argument("--conc-max-num-seqs", type=int, default=128)
    g.add_argument("--conc-max-batched-tokens", type=int, default=2048)
    g.add_argument("--conc-host-kv-mib", type=float, default=256.0, help="host tier of the 'on' engine")
    g.add_argument(
        "--conc-disk-kv-mib", type=float, default=256.0, help="disk tier of the 'on' engine (0: none)"
    )
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results path")
    p.add_argument("--plot", default=None, help="PNG path for the figure (one panel per part)")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    args = p.parse_args(argv)
    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    bad = [s for s in parts if s not in ALL_PARTS]
    if bad or not parts:
        p.error(f"--parts: unknown {bad}; choose from {ALL_PARTS}")
    args.part_list = parts
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import faulthandler

    if not faulthandler.is_enabled():
        faulthandler.enable()
    from transformers import AutoTokenizer

    from loraplex.platform.model.source import resolve_model_dir

    progress = not args.no_progress
    threads = set_torch_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    maker = PromptMaker(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
    report: dict[str, Any] = {
        "benchmark": "prefix_cache",
        "command": " ".join(["benchmarks/prefix_cache.py", *(argv if argv is not None else sys.argv[1:])]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**machine_info(), "torch_threads": threads},
        "settings": {k: v for k, v in vars(args).items() if k != "part_list"},
        "model": str(model_dir),
        "parts": {},
    }
    runners = {"ttft": part_ttft, "restore": part_restore, "concurrency": part_concurrency}
    with stopwatch() as total:
        for part in args.part_list:
            print(f"\n== {part} == (load {load_now()})", flush=True)
            with stopwatch() as t:
                report["parts"][part] = runners[part](args, maker, progress)
            report["parts"][part]["wall_seconds"] = t["seconds"]
            print(f"{part}: {t['seconds']:.0f} s", flush=True)
            if part != args.part_list[-1]:  # a long run that dies later still leaves these figures
                write_json(args.out, {**report, "partial": True})
    report["wall_seconds"] = total["seconds"]
    report["machine"]["loadavg_end"] = load_now()
    print_summary(report)
    out = write_json(args.out, report)
    print(f"\nwrote {out}")
    if args.plot:
        make_plot(Path(args.plot), report)
        print(f"wrote {args.plot}")
    return report


if __name__ == "__main__":
    main()
