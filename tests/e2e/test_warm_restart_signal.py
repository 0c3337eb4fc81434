"""A server stopped by SIGTERM (how Kubernetes stops a pod) persists its cached KV first.

uvicorn re-raises the signal from inside ``run()`` once it has shut down, and SIGTERM's
default action ends the process right there: the engine's shutdown (which writes the
cached blocks to the disk tier) has to run before that, or a restarted server starts
cold. Real processes, a real port, a real disk tier; the tiny model.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
from support.ports import free_port
from support.servers import wait_until

BLOCK = 16
PROMPT = [(7 * i) % 90 + 3 for i in range(3 * BLOCK + 5)]  # 3 full blocks + 5 tokens
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}

_SERVE = """
import sys
from loraplex.platform.api.app import build_app
from loraplex.platform.settings import ServerLimits, ServerSettings
from loraplex.platform.api.server import serve
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine

config = EngineConfig(
    model=sys.argv[1], dtype="float32", num_kv_blocks=64, block_size=16,
    host_kv_cache_bytes=1 << 20, disk_kv_path=sys.argv[3], disk_kv_cache_bytes=4 << 20,
)
app = build_app(
    AsyncEngine(LLMEngine(config)),
    ServerSettings(served_model_name="tiny", single_tenant=True, limits=ServerLimits(graceful_shutdown_s=2)),
)
sys.exit(serve(app, "127.0.0.1", int(sys.argv[2]), "warning"))
"""


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _serve_one_request_then(stop: signal.Signals, model: Path, disk: Path) -> dict[str, object]:
    """Start a server, send BODY, stop it with ``stop``; the response's JSON."""
    port = free_port()
    cmd = [sys.executable, "-c", _SERVE, str(model), str(port), str(disk)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _up(url) or proc.poll() is not None, 120, "server up")
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else "server exited"
        r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200, r.text
        proc.send_signal(stop)
        code = proc.wait(timeout=60)
        assert code in (0, -stop), proc.stdout.read() if proc.stdout else code
        return dict(r.json())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _cached(response: dict[str, object]) -> int:
    usage = response["usage"]
    assert isinstance(usage, dict)
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def test_sigterm_persists_the_kv_cache_for_a_warm_restart(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    model, disk = tiny_dirs["gqa_tied"], tmp_path / "kv"
    cold = _serve_one_request_then(signal.SIGTERM, model, disk)
    assert _cached(cold) == 0
    warm = _serve_one_request_then(signal.SIGTERM, model, disk)
    # Every full block of the prompt came back from disk (the last token is always computed).
    assert _cached(warm) == 3 * BLOCK
    assert warm["choices"] == cold["choices"]


def test_sigint_persists_the_kv_cache_too(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    model, disk = tiny_dirs["gqa_tied"], tmp_path / "kv"
    cold = _serve_one_request_then(signal.SIGINT, model, disk)
    warm = _serve_one_request_then(signal.SIGINT, model, disk)
    assert (_cached(cold), _cached(warm)) == (0, 3 * BLOCK)
    assert warm["choices"] == cold["choices"]
