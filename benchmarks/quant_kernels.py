"""CPU benchmark of a quantized base's projections: each plan of the interleaved formats
(``kernels/cpu/quant_x16.c``, ``quant_amx.c``) against the float32 path's ``F.linear`` on the
same de-quantized weights.

For SmolLM2-135M's projections (q|k|v 960 x 576, o 576 x 576, gate|up 3,072 x 576, down 576 x
1,536; the 49,152 x 576 LM head up to 64 rows) and rows of x from a decode step to a prefill
chunk, it times, interleaved round by round (medians, so a noisy machine slows every side
alike):

* ``amx``: the tile unit (where the CPU has AMX; bf16 halves for float x, int8 tiles for
  ``*a8``),
* ``direct``: the integer dot products (AVX-512 VNNI / AVX2 / generic),
* ``auto``: what the engine runs,
* ``float``: ``F.linear`` on the de-quantized float32 weights (the ``none`` path's arithmetic),

and reports milliseconds and ``float / auto`` (higher is better: how much faster the quantized
base computes the same projection).

    python benchmarks/quant_kernels.py [--formats q4_1x16,q8_0x16] [--threads N] [--repeats N]

Prints a table and writes ``quant_kernels.json`` under ``--out`` (benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplex.kernels.contracts import PackedWeight
from loraplex.kernels.cpu.quant_linear import c_kernel, has_amx, interleave, qlinear
from loraplex.kernels.formats import FORMATS

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
ROWS = (1, 16, 32, 64, 256, 2048)


@dataclass
class Row:
    """One projection at one number of rows: milliseconds per plan (None: not run)."""

    fmt: str
    shape: str
    rows: int
    amx_ms: float | None
    direct_ms: float
    auto_ms: float
    float_ms: float

    @property
    def speedup(self) -> float:
        return self.float_ms / self.auto_ms


def medians(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median milliseconds of each function, calls interleaved round by round."""
    for fn in fns:  # warm-up: builds, first-touch pages
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def packed_weight(fmt: str, n: int, k: int, gen: torch.Generator) -> PackedWeight:
    """A random ``n x k`` weight quantized to ``fmt``'s base format, then interleaved."""
    base = fmt.split("x16")[0]
    w = torch.randn(n, k, generator=gen) * 0.05
    plain = PackedWeight(FORMATS[base], FORMATS[base].quantize(w), k)  # type: ignore[index]
    return interleave(plain, int8_activations=fmt.endswith("a8"))


def bench(fmt: str, shape: str, rows: int, repeats: int, gen: torch.Generator) -> Row:
    n, k = SHAPES[shape]
    packed = packed_weight(fmt, n, k, gen)
    dense = packed.dequantize().float().contiguous()
    x = torch.randn(rows, k, generator=gen)
    plans: list[Callable[[], object]] = [
        lambda: qlinear(x, packed, None, "direct"),
        lambda: qlinear(x, packed, None, "auto"),
        lambda: F.linear(x, dense),
    ]
    amx = has_amx()
    if amx:
        plans.append(lambda: qlinear(x, packed, None, "amx"))
    times = medians(plans, repeats)
    return Row(fmt, shape, rows, times[3] if amx else None, times[0], times[1], times[2])


def print_table(rows: list[Row]) -> None:
    print("| format | projection | rows | amx ms | direct ms | auto ms | float ms | float / auto |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        amx = f"{r.amx_ms:.3f}" if r.amx_ms is not None else "-"
        print(
            f"| {r.fmt} | {r.shape} | {r.rows} | {amx} | {r.direct_ms:.3f} | {r.auto_ms:.3f} | "
            f"{r.float_ms:.3f} | {r.speedup:.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--formats", default="q4_1x16,q8_0x16,q4_1x16a8", help="interleaved formats list")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if c_kernel() is None:
        raise SystemExit("the C kernels are unavailable (no compiler?): nothing to compare")
    gen = torch.Generator().manual_seed(0)
    results: list[Row] = []
    for fmt in args.formats.split(","):
        for shape in SHAPES:
            for rows in ROWS:
                if shape == "lm_head" and rows > 64:
                    continue  # the engine computes logits for the sampled rows only
                results.append(bench(fmt, shape, rows, args.repeats, gen))
                print(f"{fmt} {shape} {rows}: float / auto {results[-1].speedup:.2f}x", flush=True)
    print_table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "quant_kernels.json"
    meta = {"threads": torch.get_num_threads(), "amx": has_amx(), "machine": platform.processor()}
    table = [asdict(r) | {"speedup": r.speedup} for r in results]
    out.write_text(json.dumps({"meta": meta, "rows": table}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
