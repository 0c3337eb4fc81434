"""CPU benchmark of the torch kernels the engine runs on the CPU.

Two questions, each answered by a ratio (lower is better):

* paged decode attention (``forward`` of the ``torch`` backend, and of the ``cpu``
  backend whose decode is the compiled C kernel, on an all-decode batch) vs
  ``F.scaled_dot_product_attention`` over the same context already laid out
  contiguously: batch 16, context 1024, block 16. Target <= 2.0.
* batched multi-adapter LoRA (``apply`` of the ``torch`` and ``cpu`` backends, each on
  weights in its own layout, as the slot buffers hold them; 16 distinct adapters) vs
  one dense ``torch.mm`` with the same FLOPs: ``x [T, in] @ W [in, N]`` with
  ``2 T in N = 2 T r (slices * in + out)``. Target <= 1.5, timed *cold*, from the
  state a real step leaves: before every timed call a read of twice the last-level
  cache (every other layer's weights pass through the caches between two uses of a
  projection's adapters), then the layer's base projection (``x @ W^T`` through the
  engine's linear backend), whose output ``y`` the LoRA delta is added into, as the
  model does. A second ratio compares
  against the same LoRA with every token on one adapter (same shapes, same FLOPs):
  what serving 16 different adapters costs over serving one; a third times LoRA and
  dense *warm* (each call right after another of its own). On a decode batch the 16
  adapters are megabytes read for a few tokens each, so cold they are bounded by
  DRAM bandwidth, while the dense ``mm`` reuses one small weight across all tokens:
  the *floor* column times a cold read of the adapters' bytes alone (a sum) over the
  dense ``mm``, the best ratio any kernel could reach on the machine.

A third table compares the ``cpu`` linear backend (packed-panel C kernel) with torch's
``F.linear`` (MKL) on the model's projections for 4, 64 and (SmolLM2) 1,024 rows (a
small and a full decode step, a prefill step): target <= 1.0, it has to be faster to be
the default.

Timings interleave the contenders round by round and report medians, so a noisy
(shared) machine slows both sides alike. Head counts: SmolLM2-135M (9 query / 3 KV
heads, head_dim 64, hidden 576) and Llama-3-8B (32 / 8, head_dim 128, hidden 4096).

    python benchmarks/cpu_kernels.py [--threads N] [--repeats N] [--out DIR]

Prints a table and writes ``cpu_kernels.json`` under ``--out`` (benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplex.kernels.contracts import AttentionBackend, LoRABackend
from loraplex.kernels.cpu.build import load_library
from loraplex.kernels.metadata import AttentionMetadata, LoRAMetadata
from loraplex.kernels.portable.attention import PortableAttentionBackend
from loraplex.kernels.portable.lora import PortableLoRABackend
from loraplex.kernels.registry import select_linear_backend

ATTENTION_TARGET = 2.0
LORA_TARGET = 1.5
LINEAR_TARGET = 1.0  # the C projection must not be slower than F.linear to be the default


@dataclass(frozen=True)
class HeadConfig:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int


SMOLLM2 = HeadConfig("SmolLM2-135M", 9, 3, 64, 576, 1536)
LLAMA3_8B = HeadConfig("Llama-3-8B", 32, 8, 128, 4096, 14336)


@dataclass
class Row:
    """One line of the table."""

    bench: str
    config: str
    shape: str
    ours_ms: float
    baseline_ms: float
    ratio: float
    target: float
    # LoRA only: the same LoRA with every token on one adapter (same shapes and FLOPs),
    # and both contenders timed warm (the cold timings above are the target's).
    one_adapter_ms: float | None = None
    floor_ms: float | None = None  # reading the adapters' weights once, cold (a sum)
    warm_ours_ms: float | None = None
    warm_baseline_ms: float | None = None

    @property
    def ok(self) -> bool:
        return self.ratio <= self.target

    @property
    def one_adapter_ratio(self) -> float | None:
        return None if self.one_adapter_ms is None else self.ours_ms / self.one_adapter_ms

    @property
    def floor_ratio(self) -> float | None:
        """The best ratio a cold LoRA call could reach here: its weight read / dense."""
        return None if self.floor_ms is None else self.floor_ms / self.baseline_ms

    @property
    def warm_ratio(self) -> float | None:
        if self.warm_ours_ms is None or self.warm_baseline_ms is None:
            return None
        return self.warm_ours_ms / self.warm_baseline_ms


def interleaved_medians(
    fns: list[Callable[[], object]],
    repeats: int,
    warmup: int = 3,
    before: Callable[[], object] | None = None,
) -> list[float]:
    """Median milliseconds of each function, timed round-robin; ``before`` runs untimed
    ahead of every timed call (a cache flush for cold timings)."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            samples[i].append(time.perf_counter() - start)
    return [statistics.median(s) * 1e3 for s in samples]


def warm_medians(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median milliseconds of each function, round-robin, each timed call right after an
    untimed call of the same function: its operands as warm as the caches keep them."""
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            fn()
            start = time.perf_counter()
            fn()
            samples[i].append(time.perf_counter() - start)
    return [statistics.median(s) * 1e3 for s in samples]


def last_level_cache_bytes() -> int:
    """Size of the CPU's largest cache from sysfs (32 MiB when it cannot be read)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=32 << 20)


class CacheFlusher:
    """Evicts the caches between timed calls by reading a buffer twice the last-level
    cache: the next call starts with its operands in DRAM, as a projection's weights
    are in a real step (every other layer's weights pass through the cache in between),
    and the lines the previous call dirtied are written back here, not during it."""

    def __init__(self) -> None:
        self.buffer = torch.ones(2 * last_level_cache_bytes() // 4)

    def __call__(self) -> object:
        return self.buffer.sum()


# -- attention ------------------------------------------------------------------------------


def bench_decode_attention(
    cfg: HeadConfig, backend: AttentionBackend, repeats: int, batch: int = 16, context: int = 1024
) -> Row:
    block_size = 16
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq + 64
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    # Shuffled blocks, as a long-running pool hands them out.
    tables = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq].view(batch, -1).int()
    query = torch.randn(batch, cfg.num_heads, cfg.head_dim, generator=gen)
    lens = [context] * batch
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        num_decodes=batch,
        max_query_len=1,
        max_seq_len=context,
        query_start_loc_cpu=tuple(range(batch + 1)),
        seq_lens_cpu=tuple(lens),
    )
    k = torch.randn(batch, cfg.num_kv_heads, context, cfg.head_dim, generator=gen)
    v = torch.randn(batch, cfg.num_kv_heads, context, cfg.head_dim, generator=gen)
    q4 = query.unsqueeze(2)
    scale = cfg.head_dim**-0.5

    def paged() -> object:
        return backend.forward(query, k_cache, v_cache, meta, scale)

    def contiguous() -> object:
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    ours, base = interleaved_medians([paged, contiguous], repeats)
    heads = f"H={cfg.num_heads}/{cfg.num_kv_heads} D={cfg.head_dim}"
    shape_str = f"B={batch} ctx={context} blk={block_size} {heads}"
    name = f"paged decode [{backend.name}] / SDPA"
    return Row(name, cfg.name, shape_str, ours, base, ours / base, ATTENTION_TARGET)


# -- LoRA -----------------------------------------------------------------------------------


def bench_lora(
    cfg: HeadConfig,
    backend: LoRABackend,
    projection: str,
    token_slots: list[int],
    label: str,
    repeats: int,
    flush: Callable[[], object],
    rank: int = 16,
    num_adapters: int = 16,
) -> Row:
    in_features = cfg.hidden
    if projection == "qkv":
        kv = cfg.num_kv_heads * cfg.head_dim
        slice_sizes: tuple[int, ...] = (cfg.num_heads * cfg.head_dim, kv, kv)
    else:  # gate_up
        slice_sizes = (cfg.intermediate, cfg.intermediate)
    gen = torch.Generator().manual_seed(1)
    num_slices = len(slice_sizes)
    lora_a = torch.randn(num_slices, num_adapters, rank, in_features, generator=gen) * 0.02
    lora_b = torch.randn(num_slices, num_adapters, max(slice_sizes), rank, generator=gen) * 0.02
    scales = torch.ones(num_adapters)
    num_tokens = len(token_slots)
    x = torch.randn(num_tokens, in_features, generator=gen)
    meta = LoRAMetadata.from_token_slots(token_slots, torch.device("cpu"))
    # The weights in the layout this backend reads, as the engine's slot buffers store them.
    a_used, b_used = backend.weight_layout(torch.float32, torch.device("cpu")).pack(lora_a, lora_b)
    # The layer's base projection, through the engine's default linear backend: the
    # model runs it right before the LoRA delta, which is added into its output.
    linear = select_linear_backend("auto", torch.device("cpu"))
    out_features = sum(slice_sizes)
    base_weight = linear.prepare(torch.randn(out_features, in_features, generator=gen) * 0.02)
    state = {"y": linear(x, base_weight, None, out_features)}

    def engine_state() -> None:
        """What a cold call starts from in a real step: every other layer's weights have
        passed through the caches (the flush), then this layer's base projection read x
        and wrote y (the engine's y, hot or not as that projection leaves it)."""
        flush()
        state["y"] = linear(x, base_weight, None, out_features)

    flops = 2 * num_tokens * rank * (num_slices * in_features + out_features)
    dense_cols = max(1, round(flops / (2 * num_tokens * in_features)))
    w_dense = torch.randn(in_features, dense_cols, generator=gen)

    def lora() -> object:
        backend.apply(state["y"], x, a_used, b_used, scales, slice_sizes, meta)
        return state["y"]

    def dense() -> object:
        return torch.mm(x, w_dense)

    # The best plain-torch LoRA when every token uses adapter 0: one shrink GEMM over
    # the stacked slices, then one expand GEMM per slice straight into y.
    a_stacked = lora_a[:, 0].reshape(num_slices * rank, in_features).t().contiguous()
    offsets = [sum(slice_sizes[:i]) for i in range(num_slices)]

    def one_adapter() -> object:
        y = state["y"]
        r = x @ a_stacked
        for s, (offset, size) in enumerate(zip(offsets, slice_sizes, strict=True)):
            y[:, offset : offset + size].addmm_(r[:, s * rank : (s + 1) * rank], lora_b[s, 0, :size].t())
        return y

    # The floor of a cold call: reading the 16 adapters' weights once from DRAM, timed as
    # a plain sum over as many bytes. On a decode batch (a few tokens per adapter) it is
    # 16x the dense weight's bytes for the same FLOPs, so floor / dense bounds the ratio.
    stream = torch.ones(num_adapters * rank * (num_slices * in_features + out_features))

    def floor() -> object:
        return stream.sum()

    ours, base, single, floor_ms = interleaved_medians(
        [lora, dense, one_adapter, floor], repeats, before=engine_state
    )
    warm_ours, warm_base = warm_medians([lora, dense], repeats)
    shape_str = f"{label}: T={num_tokens} {projection} in={in_features} out={out_features} r={rank}"
    name = f"LoRA x{num_adapters} [{backend.name}] / dense mm"
    return Row(
        name,
        cfg.name,
        shape_str,
        ours,
        base,
        ours / base,
        LORA_TARGET,
        one_adapter_ms=single,
        floor_ms=floor_ms,
        warm_ours_ms=warm_ours,
        warm_baseline_ms=warm_base,
    )


def lora_batches(num_adapters: int = 16) -> dict[str, list[int]]:
    """Token-slot layouts with 16 distinct adapters."""
    return {
        # 4 decode tokens per adapter, interleaved as requests arrive.
        "decode 64": [i % num_adapters for i in range(4 * num_adapters)],
        # 16 sequences x 128 tokens, one adapter each (prefill chunks).
        "prefill 16x128": [s for s in range(num_adapters) for _ in range(128)],
    }


# -- dense projections ----------------------------------------------------------------------


def bench_linear(cfg: HeadConfig, rows: int, repeats: int) -> Row:
    """All four projections of one layer (qkv, o, gate_up, down) for ``rows`` rows of x,
    over 8 layers' worth of distinct weights so they stream from memory as in a step."""
    from loraplex.kernels.cpu.linear import CpuLinearBackend

    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = [
        (q + 2 * kv, cfg.hidden),
        (cfg.hidden, q),
        (2 * cfg.intermediate, cfg.hidden),
        (cfg.hidden, cfg.intermediate),
    ]
    gen = torch.Generator().manual_seed(2)
    layers = 8 if cfg.hidden < 1024 else 1
    weights = [[torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes] for _ in range(layers)]
    backend = CpuLinearBackend()
    packed = [[backend.prepare(w) for w in layer] for layer in weights]
    xs = [torch.randn(rows, k, generator=gen) for _, k in shapes]

    def ours() -> object:
        for layer in packed:
            for x, w, (n, _) in zip(xs, layer, shapes, strict=True):
                backend(x, w, None, n)
        return None

    def torch_linear() -> object:
        for layer in weights:
            for x, w in zip(xs, layer, strict=True):
                F.linear(x, w)
        return None

    mine, base = interleaved_medians([ours, torch_linear], repeats)
    flops = 2 * rows * layers * sum(n * k for n, k in shapes)
    shape_str = f"rows={rows} x {layers} layers: {flops / mine / 1e6:.0f} vs {flops / base / 1e6:.0f} GFLOP/s"
    return Row("linear [cpu] / F.linear", cfg.name, shape_str, mine, base, mine / base, LINEAR_TARGET)


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'benchmark':34} {'model':13} {'shape':57} {'ours ms':>9} {'base ms':>9} {'ratio':>6} "
        f"{'target':>6}      {'1-adapter':>9} {'warm':>6} {'floor':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        verdict = "ok  " if r.ok else "MISS"
        line = (
            f"{r.bench:34} {r.config:13} {r.shape:57} {r.ours_ms:9.3f} {r.baseline_ms:9.3f} "
            f"{r.ratio:6.2f} {r.target:6.1f} {verdict}"
        )
        if r.one_adapter_ratio is not None and r.warm_ratio is not None and r.floor_ratio is not None:
            line += f" {r.one_adapter_ratio:9.2f} {r.warm_ratio:6.2f} {r.floor_ratio:6.2f}"
        print(line)
    print(
        "LoRA rows: ms and ratio cold (caches flushed, then the base projection, before every call, "
        "as in a real step); "
        "1-adapter = ours / the same LoRA with every token on one adapter (cold); "
        "warm = ours / dense with each call right after another of its own; "
        "floor = reading the adapters' weights once from DRAM (a cold sum) / dense: no kernel goes below it"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    rows: list[Row] = []
    backends: list[AttentionBackend] = [PortableAttentionBackend()]
    if load_library() is not None:
        from loraplex.kernels.cpu.attention import CpuAttentionBackend

        backends.append(CpuAttentionBackend())
    else:
        print("C kernels unavailable (no compiler or LORAPLEX_CPU_KERNELS=0): torch backend only")
    for cfg in (SMOLLM2, LLAMA3_8B):
        for backend in backends:
            rows.append(bench_decode_attention(cfg, backend, args.repeats))
    flush = CacheFlusher()
    lora_backends: list[LoRABackend] = [PortableLoRABackend()]
    if load_library() is not None:
        from loraplex.kernels.cpu.lora import CpuLoRABackend

        lora_backends.append(CpuLoRABackend())
    for cfg in (SMOLLM2, LLAMA3_8B):
        for label, slots in lora_batches().items():
            for projection in ("qkv", "gate_up"):
                for lora_backend in lora_backends:
                    rows.append(bench_lora(cfg, lora_backend, projection, slots, label, args.repeats, flush))
    if load_library() is not None:
        # Llama-3-8B's layer is 218 M parameters (0.45 TFLOP at 1,024 rows): decode sizes only.
        for cfg, sizes in ((SMOLLM2, (4, 64, 1024)), (LLAMA3_8B, (4, 64))):
            for num_rows in sizes:
                rows.append(bench_linear(cfg, num_rows, max(3, args.repeats // 3)))
    print_table(rows)

    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "load_avg_1m": round(load[0], 2),
    }
    print(
        f"\ntorch {env['torch']}, {env['threads']} threads, {env['cpu_count']} CPUs, "
        f"1-min load average {env['load_avg_1m']}"
    )
    if load[0] > (os.cpu_count() or 1) - 0.5:
        # OpenMP parallel regions stall while another process holds a core, which hits
        # the many-small-op paths far harder than one big SDPA or mm call.
        hint = " or with --threads 1" if env["threads"] != 1 else ""
        print(f"WARNING: the machine is busy and the ratios are noisy: rerun when idle{hint}.")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "cpu_kernels.json"
    payload = {
        "env": env,
        "rows": [
            asdict(r)
            | {
                "ok": r.ok,
                "one_adapter_ratio": r.one_adapter_ratio,
                "warm_ratio": r.warm_ratio,
                "floor_ratio": r.floor_ratio,
            }
            for r in rows
        ],
    }
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
