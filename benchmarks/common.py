"""Shared helpers for the scripts in ``benchmarks/``.

Everything here is engine-agnostic: seeded synthetic workloads, thread pinning,
timing, a plain-text table, the machine description and JSON output. Scripts
import it as ``benchmarks.common`` (run them from the repository root, or let them
put the root on ``sys.path`` themselves, as ``offline_throughput.py`` does).
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


# -- workloads ------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """A fixed list of requests: prompt token ids and the exact output length of each.

    ``max_tokens[i]`` is both the request's limit and, with EOS ignored, the number
    of tokens it produces, so every system emits the same number of output tokens.
    """

    prompts: list[list[int]]
    max_tokens: list[int]
    seed: int
    description: str
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    def summary(self) -> dict[str, Any]:
        pl, ol = self.prompt_lens, self.max_tokens
        return {
            "num_requests": len(self),
            "seed": self.seed,
            "description": self.description,
            "prompt_tokens": {"total": sum(pl), "min": min(pl), "mean": sum(pl) / len(pl), "max": max(pl)},
            "output_tokens": {"total": sum(ol), "min": min(ol), "mean": sum(ol) / len(ol), "max": max(ol)},
            **self.meta,
        }


def random_token_workload(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    *,
    seed: int = 0,
    exclude_ids: Sequence[int] = (),
    min_token_id: int = 0,
) -> Workload:
    """Prompts of uniformly random token ids; lengths uniform in the closed ranges given.

    Token ids are drawn uniformly from ``[min_token_id, vocab_size)`` minus
    ``exclude_ids`` (pass the tokenizer's special ids so no prompt holds BOS/EOS).
    The same arguments always give the same workload (``random.Random(seed)``).
    """
    lo_p, hi_p = prompt_len
    lo_o, hi_o = output_len
    if not (1 <= lo_p <= hi_p and 1 <= lo_o <= hi_o):
        raise ValueError(f"bad length ranges: prompt {prompt_len}, output {output_len}")
    rng = random.Random(seed)
    excluded = set(exclude_ids)
    pool = [t for t in range(min_token_id, vocab_size) if t not in excluded]
    prompt_lens = [rng.randint(lo_p, hi_p) for _ in range(num_requests)]
    max_tokens = [rng.randint(lo_o, hi_o) for _ in range(num_requests)]
    prompts = [[rng.choice(pool) for _ in range(n)] for n in prompt_lens]
    desc = (
        f"{num_requests} requests, random token ids in [{min_token_id}, {vocab_size}) minus "
        f"{len(excluded)} special ids, prompt lengths U[{lo_p}, {hi_p}], output lengths U[{lo_o}, {hi_o}], "
        f"seed {seed}"
    )
    return Workload(prompts=prompts, max_tokens=max_tokens, seed=seed, description=desc)


# -- process setup and timing -----------------------------------------------------------
def set_torch_threads(num_threads: int) -> int:
    """Pin torch's intra-op (and inter-op, where still settable) threads; returns the count."""
    import torch

    torch.set_num_threads(num_threads)
    # Inter-op threads are only settable before the first parallel op; intra-op is what matters.
    with suppress(RuntimeError):
        torch.set_num_interop_threads(num_threads)
    return torch.get_num_threads()


@contextmanager
def stopwatch() -> Iterator[dict[str, float]]:
    """``with stopwatch() as t: ...`` then ``t["seconds"]`` (wall clock, perf_counter) and
    ``t["cpu_seconds"]`` (CPU time of the whole process, all threads: on a shared machine
    it is less disturbed by other processes than wall time; on a quiet one it is about
    wall time x busy threads)."""
    box: dict[str, float] = {}
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        yield box
    finally:
        box["seconds"] = time.perf_counter() - start
        box["cpu_seconds"] = time.process_time() - cpu_start


def machine_info() -> dict[str, Any]:
    """What the figures were measured on: CPU, cores, memory, load, library versions."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    with suppress(OSError):
        info["loadavg_1_5_15"] = list(os.getloadavg())
    env = {
        k: os.environ[k]
        for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "LORAPLEX_MALLOC_TUNING")
        if k in os.environ
    }
    if env:
        info["env"] = env
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    for mod in ("torch", "transformers"):
        with suppress(ImportError):
            info[mod] = __import__(mod).__version__
    return info


# -- comparisons ------------------------------------------------------------------------
def token_agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> dict[str, float]:
    """How closely two systems' greedy outputs agree, request by request.

    ``positional``: fraction of aligned positions with the same token.
    ``prefix``: fraction of tokens before each request's first divergence (greedy
    decoding diverges for good after one flipped near-tie, so this is the stricter one).
    ``exact_requests``: fraction of requests whose outputs are identical.
    """
    total = same = prefix = exact = 0
    for a, b in zip(reference, other, strict=True):
        n = max(len(a), len(b))
        total += n
        same += sum(1 for x, y in zip(a, b, strict=False) if x == y)
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefix += k
        exact += int(list(a) == list(b))
    n_req = max(1, len(reference))
    return {
        "positional": same / total if total else 1.0,
        "prefix": prefix / total if total else 1.0,
        "exact_requests": exact / n_req,
        "num_requests": len(reference),
        "num_tokens": total,
    }


# -- HF peers ----------------------------------------------------------------------------
def generate_left_padded(
    model: Any, prompts: list[list[int]], max_new: int, pad_id: int, **generate_kwargs: Any
) -> list[list[int]]:
    """One static HF ``generate`` batch: prompts left-padded to the longest, greedy.

    Returns each row's new tokens (``max_new`` of them: callers keep only what a
    request asked for). Extra keyword arguments go to ``generate`` (PEFT's
    ``adapter_names``, for example).
    """
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):  # left padding
        ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[r, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad_id,
            **generate_kwargs,
        )
    return [row[width:].tolist() for row in out]


# -- output -----------------------------------------------------------------------------
def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], floatfmt: str = ".1f") -> str:
    """A plain monospace table (right-aligned numbers), also valid as a Markdown table."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return format(v, floatfmt)
        return str(v)

    body = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]

    def line(vals: Sequence[str]) -> str:
        return "| " + " | ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(list(headers)), sep, *(line(r) for r in body)])


def _jsonable(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(asdict(obj))
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and obj != obj:  # NaN is not JSON
        return None
    return obj


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` (dicts, lists, dataclasses, Paths) as indented JSON; creates parents."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_jsonable(data), indent=2) + "\n")
    return out
