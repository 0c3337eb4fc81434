"""The ``loraplex`` command line: ``loraplex serve`` starts the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from loraplex.platform.config import EngineConfig


def _parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1e9' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    low = text.strip().lower()
    for suffix, mult in units.items():
        if low.endswith(suffix):
            return int(float(low[: -len(suffix)]) * mult)
    return int(float(low))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description="Multi-tenant LoRA serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    serve.add_argument(
        "--model",
        default=None,
        help="local HF directory or .gguf file (default: bundled SmolLM2-135M-Instruct)",
    )
    serve.add_argument(
        "--served-model-name", default=None, help="model id clients send (default: the model's folder name)"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--device", default="auto")
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--max-num-seqs", type=int, default=128)
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument(
        "--kv-cache-memory", type=_parse_bytes, default=None, help="KV pool size on CPU, e.g. 2GiB"
    )
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    serve.add_argument("--attention-backend", choices=["auto", "torch", "triton", "cpu"], default="auto")
    serve.add_argument(
        "--lora-backend",
        choices=["auto", "torch", "triton", "cpu"],
        default="auto",
        help="LoRA kernels (auto: Triton on CUDA, the C kernels on CPU when they build)",
    )
    serve.add_argument(
        "--linear-backend",
        choices=["auto", "torch", "cpu"],
        default="auto",
        help="dense projections (auto: the C packed-panel kernel on CPU for float32, else torch)",
    )
    serve.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    serve.add_argument(
        "--lora-modules",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="adapters to serve: clients select one with model=NAME (implies --enable-lora)",
    )
    serve.add_argument("--max-loras", type=int, default=4, help="adapter slots in accelerator memory")
    serve.add_argument("--max-cpu-loras", type=int, default=None, help="adapters cached in host memory")
    serve.add_argument("--max-lora-rank", type=int, default=64)
    serve.add_argument("--log-level", default="info")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "serve":
        return _serve(args)
    return 2


def _register_loras(engine: Any, specs: list[str]) -> dict[str, Any]:
    """Validate and register ``NAME=PATH`` adapters; return name -> LoRARequest."""
    from loraplex.adapters import LoRARequest

    loras: dict[str, Any] = {}
    for i, spec in enumerate(specs, start=1):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules expects NAME=PATH, got {spec!r}")
        if name in loras:
            raise ValueError(f"--lora-modules names {name!r} twice")
        lora = LoRARequest(name, i, path)
        engine.add_lora(lora)
        loras[name] = lora
    return loras


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from loraplex.platform.async_engine import AsyncEngine
    from loraplex.platform.engine import LLMEngine
    from loraplex.platform.server import build_app

    try:
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            seed=args.seed,
            scheduling_policy=args.scheduling_policy,
            attention_backend=args.attention_backend,
            lora_backend=args.lora_backend,
            linear_backend=args.linear_backend,
            enable_lora=args.enable_lora or bool(args.lora_modules),
            max_loras=args.max_loras,
            max_cpu_loras=args.max_cpu_loras,
            max_lora_rank=args.max_lora_rank,
        )
        engine = LLMEngine(config)
        loras = _register_loras(engine, args.lora_modules)
    except (ValueError, FileNotFoundError) as exc:
        print(f"loraplex: {exc}", file=sys.stderr)
        return 2
    name = (
        args.served_model_name
        or (args.model and str(args.model).rstrip("/").split("/")[-1])
        or "SmolLM2-135M-Instruct"
    )
    async_engine = AsyncEngine(engine)
    try:
        uvicorn.run(
            build_app(async_engine, name, loras), host=args.host, port=args.port, log_level=args.log_level
        )
    finally:
        async_engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
