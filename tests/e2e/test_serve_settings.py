"""Settings reach a real ``loraplex serve`` from the environment and from the config file, in
every section: the process is started as an operator (or a Helm chart) would start it, and each
setting is observed through what it changes (the port it binds, the model id it serves, the
engine's KV pool and limits, the request limits, the database the gateway writes)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from support.ports import free_port

from loraplex.platform.api.services import tenants
from loraplex.platform.model.arch import ModelArch
from loraplex.platform.model.loader import load_hf_config
from loraplex.storage.db import Database
from loraplex.storage.kv.kv_cache import kv_bytes_per_block

ADMIN_TOKEN = "settings-e2e-admin-token-0123456789"


@contextmanager
def serve(args: list[str], env: dict[str, str], log: Path) -> Iterator[str]:
    """``loraplex serve ARGS`` in a child process with ``env``; yields its URL once healthy."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "loraplex.cli", "serve", *args],
            env={**clean, "PYTHONUNBUFFERED": "1", **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{env['LORAPLEX_PORT']}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up:\n" + log.read_text()
            time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _num_kv_blocks(log: Path) -> int:
    found = re.search(r"engine ready: .*?, (\d+) KV blocks of", log.read_text())
    assert found is not None, log.read_text()
    return int(found.group(1))


@pytest.mark.slow
def test_env_and_file_reach_serving_engine_and_limits(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = tiny_dirs["gqa_tied"]
    config = tmp_path / "server.toml"
    config.write_text(
        '[serving]\nserved_model_name = "from-file"\n'
        '[engine]\nkv_cache_memory = "1GiB"\n'
        "[limits]\nmax_stop_strings = 1\n"
    )
    env = {
        "LORAPLEX_CONFIG_FILE": str(config),
        "LORAPLEX_PORT": str(free_port()),  # serving
        "LORAPLEX_MAX_NUM_SEQS": "2",  # engine
        "LORAPLEX_MAX_N": "5",  # limits
    }
    log = tmp_path / "serve.log"
    with serve(["--single-tenant", "--model", str(model), "--dtype", "float32"], env, log) as url:
        # serving: the port from the environment (we are talking to it), the name from the file.
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["from-file"]
        body = {"model": "from-file", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json={**body, "n": 2}, timeout=60).status_code == 200
        # engine: max_num_seqs from the environment refuses n=3 (more than it runs at once) ...
        r = httpx.post(f"{url}/v1/completions", json={**body, "n": 3}, timeout=60)
        assert r.status_code == 400 and "max_num_seqs=2" in r.json()["error"]["message"], r.text
        # ... and kv_cache_memory = "1GiB" from the file sized the KV pool.
        arch = ModelArch.from_hf_config(load_hf_config(model))
        per_block = kv_bytes_per_block(arch.num_layers, 16, arch.num_kv_heads, arch.head_dim, torch.float32)
        assert _num_kv_blocks(log) == (1 << 30) // per_block
        # limits: max_n from the environment, max_stop_strings from the file.
        r = httpx.post(f"{url}/v1/completions", json={**body, "n": 6}, timeout=60)
        assert r.status_code == 400 and "limit of 5" in r.json()["error"]["message"], r.text
        r = httpx.post(f"{url}/v1/completions", json={**body, "stop": ["a", "b"]}, timeout=60)
        assert r.status_code == 400 and "limit of 1" in r.json()["error"]["message"], r.text


@pytest.mark.slow
def test_env_and_file_reach_the_gateway(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    database = tmp_path / "from-file.db"
    config = tmp_path / "server.toml"
    config.write_text(
        f'[gateway]\ndatabase_url = "sqlite+aiosqlite:///{database}"\n'
        f'adapter_store = "{tmp_path / "store"}"\n'
    )
    env = {
        "LORAPLEX_CONFIG_FILE": str(config),
        "LORAPLEX_PORT": str(free_port()),
        "LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN,  # gateway, from the environment
    }
    log = tmp_path / "serve.log"
    with serve(["--model", str(tiny_dirs["gqa_tied"]), "--dtype", "float32"], env, log) as url:
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        r = httpx.post(f"{url}/admin/api/tenants", json={"name": "acme"}, headers=admin, timeout=30)
        assert r.status_code == 201, r.text
        assert httpx.get(f"{url}/admin/api/tenants", timeout=30).status_code == 401

    async def names() -> list[str]:
        db = Database(f"sqlite+aiosqlite:///{database}")
        try:
            async with db.transaction() as session:
                return [t.name for t in await tenants.list_tenants(session)]
        finally:
            await db.dispose()

    assert asyncio.run(names()) == ["acme"]  # the database the file named
