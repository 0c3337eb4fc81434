"""Gateway replicas as the Helm chart runs them: ``loraplex serve`` processes on loopback that
share one database, one Redis and one adapter folder (``tests/e2e/test_replicas.py``,
``test_replica_invalidation.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from support.gateway import ADMIN_TOKEN, MAX_LORA_RANK
from support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
"""The repository root: the replicas import this checkout's ``loraplex``."""
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
BASE = "tiny"
AUTH_CACHE_TTL_S = 2.0
PROMPT = list(range(5, 45))  # 40 tokens: two full KV blocks of 16 for the prefix cache


class Replica:
    """One ``loraplex serve`` process on loopback, its log in a file."""

    def __init__(self, name: str, log: Path, process: subprocess.Popen[bytes], port: int) -> None:
        self.name, self.log, self.process = name, log, process
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, f"replica {self.name} exited:\n{self.log.read_text()}"
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"replica {self.name} did not start:\n{self.log.read_text()}"
            time.sleep(0.25)

    def stop(self) -> None:
        self.client.close()
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def start_replica(name: str, tmp: Path, model: Path, shared: dict[str, str]) -> Replica:
    port = free_port()
    settings = {
        "LORAPLEX_HOST": "127.0.0.1",
        "LORAPLEX_PORT": str(port),
        "LORAPLEX_MODEL": str(model),
        "LORAPLEX_SERVED_MODEL_NAME": BASE,
        "LORAPLEX_DTYPE": "float32",
        "LORAPLEX_NUM_KV_BLOCKS": "128",
        "LORAPLEX_MAX_LORA_RANK": str(MAX_LORA_RANK),
        "LORAPLEX_MAX_LORAS": "2",
        "LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN,
        "LORAPLEX_DATA_DIR": str(tmp / name),
        "LORAPLEX_LOG_LEVEL": "info",
        "LORAPLEX_AUTH_CACHE_TTL_S": str(AUTH_CACHE_TTL_S),
        **shared,
    }
    env = {**os.environ, "PYTHONPATH": str(REPO), **settings}
    log = tmp / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "loraplex.cli", "serve"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Replica(name, log, process, port)


def tenant_key(replica: Replica, tenant: str, **quotas: int) -> tuple[str, int]:
    r = replica.client.post("/admin/api/tenants", json={"name": tenant, **quotas}, headers=ADMIN)
    assert r.status_code == 201, r.text
    r = replica.client.post(f"/admin/api/tenants/{tenant}/keys", json={}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return r.json()["key"], r.json()["id"]
