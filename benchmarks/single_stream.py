"""Single stream: loraplex vs llama.cpp (``llama-cpp-python``) on the same GGUF file and threads.

One request at a time, the way a laptop user tries a model: a prompt of ``--prompt-len``
random tokens, then ``--gen`` tokens greedy (EOS ignored), timed from submission to the
last token (prefill included) for both systems, side by side in one process::

    .venv/bin/python benchmarks/single_stream.py                     # Q4_1, Q8_0, float32; 5 repeats
    .venv/bin/python benchmarks/single_stream.py --repeats 1 --gen 16  # quick check

Formats (``--formats``):

* ``q4_1``: the bundled SmolLM2 file; loraplex with ``quantization="gguf"``.
* ``q8_0``: that file requantized by llama.cpp's own ``llama_model_quantize`` (made once
  into the cache folder); loraplex with ``quantization="gguf"``.
* ``f32``: loraplex's float path (``quantization="none"``, float32) on the Q4_1 file, against
  llama.cpp on the same Q4_1 file.

Every repeat uses a fresh prompt (the same for both systems), so no prefix cache helps either.
The figure is generated tokens / wall seconds, median over ``--repeats``; the ratio is
loraplex's over llama.cpp's. ``--rss`` also loads each format in a fresh process and reports
the resident memory the load added (weights, plus a 16-block KV pool), beside the file's size.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, set_torch_threads, write_json  # noqa: E402

DEFAULT_OUT = RESULTS_DIR / "single_stream.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="threads of both systems")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=128, help="generated tokens per request")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--formats", default="q4_1,q8_0,f32", help="comma-separated: q4_1, q8_0, f32")
    p.add_argument("--no-llama-cpp", action="store_true", help="loraplex only")
    p.add_argument(
        "--quantization",
        default="gguf",
        choices=["gguf", "gguf_a8"],
        help="loraplex's setting for q4_1 / q8_0 (gguf_a8: llama.cpp's int8 activations)",
    )
    p.add_argument("--rss", action="store_true", help="also measure resident memory after load per format")
    p.add_argument("--rss-only", action="store_true", help="only the resident memory per format")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--measure-rss", default=None, help=argparse.SUPPRESS)  # child process mode
    return p.parse_args(argv)


def q8_0_file(source: Path) -> Path:
    """``source`` requantized to Q8_0 by llama.cpp (cached next to the converted models)."""
    from loraplex.paths import cache_root

    out = cache_root() / "models" / f"{source.stem.split('.')[0]}.Q8_0.gguf"
    if out.exists():
        return out
    import llama_cpp

    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    tmp = out.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc})")
    tmp.rename(out)
    return out


def files(formats: list[str]) -> dict[str, Path]:
    from loraplex.platform.model.source import default_gguf_path

    q4_1 = default_gguf_path()
    return {f: q8_0_file(q4_1) if f == "q8_0" else q4_1 for f in formats}


def loraplex_engine(fmt: str, path: Path, threads: int, quantization: str = "gguf", **kw: Any) -> Any:
    from loraplex import LLM

    quant = {"quantization": "none", "dtype": "float32"} if fmt == "f32" else {"quantization": quantization}
    return LLM(model=str(path), num_threads=threads, max_num_seqs=1, **quant, **kw)  # type: ignore[arg-type]


def time_loraplex(llm: Any, prompt: list[int], gen: int) -> float:
    from loraplex import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert len(out[0].outputs[0].token_ids) == gen
    return gen / elapsed


def time_llama_cpp(llm: Any, prompt: list[int], gen: int) -> float:
    llm.reset()
    start = time.perf_counter()
    for n, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True), start=1):
        if n == gen:
            break
    return gen / (time.perf_counter() - start)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def live_tensor_bytes() -> int:
    """Bytes of the distinct CPU tensor storages alive now (weights, KV, buffers)."""
    import gc

    import torch

    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def measure_rss(fmt: str, threads: int) -> None:
    """Child process: resident bytes a load adds, after the imports, the C kernels, the GGUF
    conversion (cached) and one tokenizer (~100 MB of the process for SmolLM2's 49,152-token
    BPE, whatever the weight format) are done. A warm-up engine would be wrong here: the
    engine keeps freed heap (host_memory.py), so a second load would reuse the first one's
    pages. Also reports the tensors the load added (weights + the 16-block KV cache)."""
    import gguf  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoTokenizer

    from loraplex import LLM  # noqa: F401
    from loraplex.kernels.cpu.build import load_library
    from loraplex.platform.model.source import resolve_model_dir

    path = files([fmt])[fmt]
    load_library()
    model_dir = resolve_model_dir(str(path))
    AutoConfig.from_pretrained(str(model_dir))
    start = rss_bytes()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    before = rss_bytes()
    tensors_before = live_tensor_bytes()
    llm = loraplex_engine(fmt, path, threads, num_kv_blocks=16)
    after = rss_bytes()
    report = {
        "rss_added": after - before,
        "tokenizer_rss": before - start,
        "tensor_bytes": live_tensor_bytes() - tensors_before,
        "file": path.stat().st_size,
        "engine": id(llm) > 0 and id(tokenizer) > 0,
    }
    print(json.dumps(report))


def rss_per_format(formats: list[str], threads: int) -> dict[str, dict[str, int]]:
    out = {}
    for fmt in formats:
        cmd = [sys.executable, __file__, "--measure-rss", fmt, "--threads", str(threads)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[fmt] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.measure_rss:
        measure_rss(args.measure_rss, args.threads)
        return {}
    set_torch_threads(args.threads)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    paths = files(formats)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(args.prompt_len)] for _ in range(args.repeats + 1)]

    results: dict[str, dict[str, Any]] = {fmt: {"file": paths[fmt].name} for fmt in formats}
    llama_by_file: dict[Path, Any] = {}
    for fmt in [] if args.rss_only else formats:
        llm = loraplex_engine(
            fmt, paths[fmt], args.threads, args.quantization, num_kv_blocks=64, enable_prefix_caching=False
        )
        peer = None
        if not args.no_llama_cpp:
            if paths[fmt] not in llama_by_file:
                from llama_cpp import Llama

                llama_by_file[paths[fmt]] = Llama(
                    model_path=str(paths[fmt]),
                    n_threads=args.threads,
                    n_threads_batch=args.threads,
                    n_ctx=args.prompt_len + args.gen + 16,
                    n_batch=512,
                    verbose=False,
                )
            peer = llama_by_file[paths[fmt]]
        # Warm-up (prompt 0, untimed): kernels built, caches and thread pools started.
        time_loraplex(llm, prompts[0], 8)
        if peer is not None:
            time_llama_cpp(peer, prompts[0], 8)
        ours, theirs = [], []
        for prompt in prompts[1:]:  # alternate the systems, one prompt each
            ours.append(time_loraplex(llm, prompt, args.gen))
            if peer is not None:
                theirs.append(time_llama_cpp(peer, prompt, args.gen))
        row: dict[str, Any] = {
            "file": paths[fmt].name,
            "loraplex_tok_s": statistics.median(ours),
            "runs": ours,
        }
        if theirs:
            row["llama_cpp_tok_s"] = statistics.median(theirs)
            row["llama_cpp_runs"] = theirs
            row["ratio"] = row["loraplex_tok_s"] / row["llama_cpp_tok_s"]
        results[fmt] = row
        peer_tok_s = row.get("llama_cpp_tok_s", 0.0)
        print(f"{fmt}: loraplex {row['loraplex_tok_s']:.2f} tok/s, llama.cpp {peer_tok_s:.2f}", flush=True)
        del llm
    if args.rss or args.rss_only:
        for fmt, rss in rss_per_format(formats, args.threads).items():
            results[fmt]["rss_added_bytes"] = rss["rss_added"]
            results[fmt]["tensor_bytes"] = rss["tensor_bytes"]
            results[fmt]["tokenizer_rss_bytes"] = rss["tokenizer_rss"]
            results[fmt]["file_bytes"] = rss["file"]

    headers = [
        "format",
        "file",
        "loraplex tok/s",
        "llama.cpp tok/s",
        "ratio",
        "RSS added MB",
        "tensors added MB",
        "file MB",
    ]
    rows = [
        [
            fmt,
            r["file"],
            r.get("loraplex_tok_s", float("nan")),
            r.get("llama_cpp_tok_s", float("nan")),
            r.get("ratio", float("nan")),
            r.get("rss_added_bytes", 0) / 1e6,
            r.get("tensor_bytes", 0) / 1e6,
            r.get("file_bytes", 0) / 1e6,
        ]
        for fmt, r in results.items()
    ]
    print(format_table(headers, rows, floatfmt=".2f"))
    report = {"args": vars(args), "machine": machine_info(), "results": results}
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
