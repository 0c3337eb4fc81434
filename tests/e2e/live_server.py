"""A real uvicorn server on loopback, in a background thread of the test process.

The tests then talk to it over a real socket (disconnects need one) and can still
read the engine's state (free blocks, adapter pins) directly.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

from loraplex.adapters import LoRARequest
from loraplex.platform.api.app import build_app
from loraplex.platform.api.server import Server
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.settings import ServerLimits, ServerSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LiveServer:
    """A started server; ``stop()`` returns its exit code."""

    url: str
    engine: LLMEngine
    async_engine: AsyncEngine
    server: Server
    thread: threading.Thread
    exit_codes: list[int] = field(default_factory=list)

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)

    def wait_exit(self, timeout_s: float) -> int | None:
        self.thread.join(timeout_s)
        return self.exit_codes[0] if self.exit_codes else None

    def stop(self) -> int | None:
        self.server.stop()
        return self.wait_exit(60)


def start_server(
    engine: LLMEngine,
    name: str,
    loras: Mapping[str, LoRARequest] | None = None,
    limits: ServerLimits | None = None,
) -> LiveServer:
    async_engine = AsyncEngine(engine)
    settings = ServerSettings(served_model_name=name, single_tenant=True, limits=limits or ServerLimits())
    app = build_app(async_engine, settings, loras)
    port = free_port()
    server = Server(app, "127.0.0.1", port, log_level="warning")
    live = LiveServer(f"http://127.0.0.1:{port}", engine, async_engine, server, threading.Thread())
    live.thread = threading.Thread(target=lambda: live.exit_codes.append(server.run()), daemon=True)
    live.thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert live.thread.is_alive(), "the server thread exited during start-up"
        assert time.monotonic() < deadline, "the server did not start in 60 s"
        time.sleep(0.05)
    return live


def sse_lines(response: httpx.Response) -> Iterator[str]:
    """The ``data:`` payloads of a streamed response."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def stream_text(lines: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """Concatenated text of choice 0 (chat or completions) and the error events, if any."""
    text, errors = [], []
    for payload in lines:
        if payload == "[DONE]":
            continue
        body = json.loads(payload)
        if "error" in body:
            errors.append(body["error"])
            continue
        for choice in body["choices"]:
            if choice["index"] == 0:
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text), errors


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``predicate`` until true; return the seconds it took."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - start


def make_small_adapter(base_dir: Path, out: Path, rank: int = 4, seed: int = 0) -> Path:
    """A PEFT LoRA (q_proj and v_proj of every layer) with small random weights."""
    cfg = json.loads((base_dir / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    outs = {"q_proj": cfg["num_attention_heads"] * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for module, out_features in outs.items():
            key = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(outs),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": str(base_dir),
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out
