"""What the multi-LoRA benchmarks run: the seeded workload, which adapter each request names,
the random PEFT adapters, and the command-line flags the scripts share.

Used by ``multi_lora_throughput.py`` (N adapters, power-law popularity), ``many_adapters.py``
(hundreds to thousands of distinct adapters) and ``lora_vs_base.py`` (``make_adapters``).

Popularity (S-LoRA's synthetic trace, ``benchmarks/trace.py`` of S-LoRA): request j draws
``x_j ~ Power(alpha)`` (numpy's ``power``: density ``alpha * x^(alpha-1)`` on [0, 1]) and uses
adapter ``floor(x_j * N)``, so

    P(adapter i) = ((i + 1) / N)^alpha - (i / N)^alpha,   i = 0 .. N-1

(alpha = 0.3: adapter 0 takes 35% of the requests at N = 32, the tail is long). The same
``x_j`` serve every N, so the runs differ only in how finely they are split. ``zipf`` uses
``P(i) ∝ (i + 1)^-alpha`` instead. ``uniform_assignment`` gives every adapter about as many
requests (1 or 2 for between N and 2N requests).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.common import Workload, random_token_workload


# -- flags -----------------------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    """A comma list of positive integers, sorted, each once."""
    vals = sorted({int(v) for v in text.split(",") if v.strip()})
    if not vals or vals[0] < 1:
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return vals


def name_list(text: str) -> list[str]:
    return [m for m in text.split(",") if m]


def add_shared_args(
    p: argparse.ArgumentParser,
    *,
    num_requests: int | None,
    num_requests_help: str,
    rank: int,
    target_modules: tuple[str, ...],
    target_modules_help: str,
    max_num_batched_tokens: int | None,
    kv_cache_gib: float | None,
    out: Path,
    plot_help: str,
) -> None:
    """The flags both multi-LoRA benchmarks take; the defaults that differ are arguments.
    ``finish_shared_args`` completes what depends on other flags."""
    p.add_argument(
        "--model", default=None, help="HF model directory (default: the bundled SmolLM2-135M-Instruct)"
    )
    p.add_argument("--num-requests", type=int, default=num_requests, help=num_requests_help)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="workload seed (prompts, lengths)")
    p.add_argument("--alpha", type=float, default=0.3, help="power-law exponent of adapter popularity")
    p.add_argument(
        "--popularity",
        choices=["slora", "zipf"],
        default="slora",
        help="slora: adapter floor(N * x), x ~ Power(alpha) (S-LoRA's trace); zipf: P(i) ∝ (i+1)^-alpha",
    )
    p.add_argument("--popularity-seed", type=int, default=42, help="seed of the adapter draw (S-LoRA: 42)")
    p.add_argument("--rank", type=int, default=rank, help=f"adapter rank (default {rank})")
    p.add_argument(
        "--lora-alpha",
        type=int,
        default=None,
        help="PEFT lora_alpha (scale = lora_alpha / rank; default 2 x rank)",
    )
    p.add_argument(
        "--target-modules", type=name_list, default=",".join(target_modules), help=target_modules_help
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
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=max_num_batched_tokens,
        help="(default: the engine's)"
        if max_num_batched_tokens is None
        else f"(default {max_num_batched_tokens}, as the engine benchmark)",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=kv_cache_gib,
        help="KV cache memory in GiB "
        + ("(default: the engine's)" if kv_cache_gib is None else f"(default {kv_cache_gib})"),
    )
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
    p.add_argument("--peft-batch-size", type=int, default=16)
    p.add_argument("--skip-peft", action="store_true")
    p.add_argument(
        "--no-bracket-base", action="store_true", help="run the base model once (before), not before+after"
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-ups")
    p.add_argument("--out", default=str(out), help=f"JSON results path (default {out})")
    p.add_argument("--plot", default=None, help=plot_help)
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")


def finish_shared_args(args: argparse.Namespace) -> None:
    if args.lora_alpha is None:
        args.lora_alpha = 2 * args.rank


# -- workload --------------------------------------------------------------------------------
def build_workload(args: argparse.Namespace, model_dir: Path) -> Workload:
    """``--num-requests`` random-token requests (special tokens excluded), lengths uniform."""
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


def subset(wl: Workload, k: int) -> Workload:
    """The first ``k`` requests of ``wl``."""
    return Workload(
        prompts=wl.prompts[:k],
        max_tokens=wl.max_tokens[:k],
        seed=wl.seed,
        description=f"first {k} requests of: {wl.description}",
    )


# -- which adapter each request names ----------------------------------------------------------
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


def adapter_histogram(assign: list[int], n: int) -> list[int]:
    counts = [0] * n
    for a in assign:
        counts[a] += 1
    return counts


# -- adapters --------------------------------------------------------------------------------
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
        model.save_pretrained(str(path))
        paths.append(path)
    del model, base
    gc.collect()
    return paths


def adapter_size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir()) / 2**20


@contextmanager
def adapter_folder(adapter_dir: str | None, prefix: str) -> Iterator[Path]:
    """``--adapter-dir`` (made if missing, kept), else a temporary folder removed at the end."""
    if adapter_dir:
        root = Path(adapter_dir)
        root.mkdir(parents=True, exist_ok=True)
        yield root
        return
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
