"""The ``loraplex`` command line.

``loraplex serve`` starts the multi-tenant gateway (API keys, quotas, adapter uploads) over
the engine; ``--single-tenant`` starts the plain OpenAI-compatible server instead.
``loraplex tenants|keys|adapters ...`` manage the gateway's database (``gateway_cli``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import ValidationError

from loraplex.platform import gateway_cli
from loraplex.platform.api.limits import ServerLimits
from loraplex.platform.config_flags import add_config_flags, config_from_args
from loraplex.platform.engine.config import EngineConfig

if TYPE_CHECKING:
    from loraplex.adapters.request import LoRARequest
    from loraplex.platform.engine.engine import LLMEngine


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description="Multi-tenant LoRA serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible HTTP server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument(
        "--served-model-name", default=None, help="model id clients send (default: the model's folder name)"
    )
    # None: LORAPLEX_HOST / LORAPLEX_PORT and the config file apply, then 127.0.0.1:8000.
    serve.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; LORAPLEX_HOST)")
    serve.add_argument("--port", type=int, default=None, help="port (default 8000; LORAPLEX_PORT)")
    serve.add_argument(
        "--single-tenant",
        action="store_true",
        help="the OpenAI-compatible server without tenants, keys or quotas (needed for --lora-modules)",
    )
    serve.add_argument(
        "--lora-modules",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="adapters to serve: clients select one with model=NAME (implies --enable-lora)",
    )
    serve.add_argument("--log-level", default="info")
    add_config_flags(serve, EngineConfig, title="engine (EngineConfig)")
    add_config_flags(serve, ServerLimits, title="request limits (ServerLimits)")
    gateway_cli.add_gateway_flags(serve, skip=("host", "port"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in gateway_cli.COMMANDS:
        return gateway_cli.main(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "serve":
        return _serve(args)
    return 2


def _register_loras(engine: LLMEngine, specs: list[str], base_name: str) -> dict[str, LoRARequest]:
    """Validate and register ``NAME=PATH`` adapters; return name -> LoRARequest."""
    from loraplex.adapters import LoRARequest

    loras: dict[str, LoRARequest] = {}
    for i, spec in enumerate(specs, start=1):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules expects NAME=PATH, got {spec!r}")
        if name in loras:
            raise ValueError(f"--lora-modules names {name!r} twice")
        if name == base_name:
            raise ValueError(
                f"--lora-modules: adapter {name!r} has the served model's name; requests could not reach it"
            )
        lora = LoRARequest(name, i, path)
        engine.add_lora(lora)
        loras[name] = lora
    return loras


def _serve(args: argparse.Namespace) -> int:
    from loraplex.platform.api.app import build_app
    from loraplex.platform.api.server import serve
    from loraplex.platform.engine.async_engine import AsyncEngine
    from loraplex.platform.engine.engine import LLMEngine

    name = (
        args.served_model_name
        or (args.model and str(args.model).rstrip("/").split("/")[-1])
        or "SmolLM2-135M-Instruct"
    )
    settings = None
    if not args.single_tenant:
        if args.lora_modules:
            print(
                "loraplex: --lora-modules needs --single-tenant; upload adapters with POST /v1/adapters "
                "or `loraplex adapters upload`",
                file=sys.stderr,
            )
            return 2
        try:
            settings = gateway_cli.gateway_settings(args)
        except ValidationError as exc:
            print(f"loraplex: {exc}", file=sys.stderr)
            return 2
    try:
        config = config_from_args(
            EngineConfig,
            args,
            enable_lora=args.enable_lora or bool(args.lora_modules) or settings is not None,
        )
        limits = config_from_args(ServerLimits, args)
        engine = LLMEngine(config)
        loras = _register_loras(engine, args.lora_modules, name)
    except (ValueError, FileNotFoundError) as exc:
        print(f"loraplex: {exc}", file=sys.stderr)
        return 2
    async_engine = AsyncEngine(engine)
    if settings is not None:
        from loraplex.platform.api.gateway import build_gateway

        gateway = build_gateway(async_engine, settings, name, limits)
        return serve(gateway, settings.host, settings.port, args.log_level)
    try:
        app = build_app(async_engine, name, loras, limits)
    except ValueError as exc:
        async_engine.shutdown()
        print(f"loraplex: {exc}", file=sys.stderr)
        return 2
    # Returns 1 when the engine died (so a supervisor restarts the process), 0 on a clean stop.
    return serve(app, args.host or "127.0.0.1", args.port or 8000, args.log_level)


if __name__ == "__main__":
    raise SystemExit(main())
