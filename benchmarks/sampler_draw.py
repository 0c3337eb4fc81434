"""The sampler's draw side by side: ``torch.multinomial`` per row (before) against the batched
inverse-transform draw (``Sampler._draw``, now), on SmolLM2-sized rows (49,152 tokens).

    .venv/bin/python benchmarks/sampler_draw.py                # ~20 s
    .venv/bin/python benchmarks/sampler_draw.py --rows 1 16 64 --threads 2

For each batch size: milliseconds per step for the draw alone, each way, and their ratio; the
two ways draw from the same distribution (``tests/platform/engine/test_sampling.py`` checks the
new one with a chi-square test), not the same tokens for a seed. Writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks.common import RESULTS_DIR, format_table, machine_info, set_torch_threads, write_json  # noqa: E402
from loraplex.platform.engine.host_memory import tune_host_malloc  # noqa: E402
from loraplex.platform.engine.sampler import Sampler  # noqa: E402

VOCAB = 49_152


def _ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "sampler_draw.json")
    args = parser.parse_args()
    set_torch_threads(args.threads)
    tune_host_malloc()  # as the engine does: megabyte-sized temporaries are not mmapped per call
    sampler = Sampler(torch.Generator().manual_seed(0))
    table, records = [], []
    for rows in args.rows:
        probs = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows)).softmax(dim=-1)
        generators = [torch.Generator().manual_seed(i) for i in range(rows)]

        def before(probs: torch.Tensor = probs, generators: list[torch.Generator] = generators) -> None:
            for row, gen in enumerate(generators):
                torch.multinomial(probs[row], 1, generator=gen)

        def now(probs: torch.Tensor = probs, generators: list[torch.Generator] = generators) -> None:
            sampler._draw(probs, list(generators))

        before_ms, now_ms = _ms(before, args.repeats), _ms(now, args.repeats)
        table.append([rows, before_ms, now_ms, before_ms / now_ms])
        records.append({"rows": rows, "multinomial_ms": before_ms, "inverse_cdf_ms": now_ms})
    print(format_table(["rows", "multinomial ms", "inverse-CDF ms", "speed-up x"], table, floatfmt=".2f"))
    write_json(args.out, {"machine": machine_info(), "threads": args.threads, "results": records})


if __name__ == "__main__":
    main()
