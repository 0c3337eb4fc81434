"""A real Redis for tests (a pytest plugin, listed in ``pytest_plugins`` of tests/conftest.py).

Fixtures:
    redis_url           a Redis for the session: ``LORAPLEX_TEST_REDIS_URL`` if set, else the
                        machine's at 127.0.0.1:6379 if it answers, else a throwaway redis-server
    redis_key_prefix    a fresh key prefix for one test on ``redis_url``; its keys are deleted after
    redis_process       a private redis-server for one test, which it may ``kill`` and ``start``
                        again on the same port (never the machine's shared Redis)

A missing ``redis-server`` is installed with apt-get when running as root; otherwise the tests
fail with the reason -- they never skip because Redis is missing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from support.ports import free_port

MACHINE_REDIS = ("127.0.0.1", 6379)
_START_TIMEOUT_S = 10.0


def redis_answers(host: str, port: int, timeout_s: float = 0.3) -> bool:
    """True when something at host:port answers PING with PONG."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def redis_server_binary() -> str:
    """Path of ``redis-server``, installed with apt-get when missing and running as root."""
    found = shutil.which("redis-server")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", "redis-server"]
        if subprocess.run(install, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True)
            subprocess.run(install, env=env, capture_output=True)
        found = shutil.which("redis-server")
    if found is None:
        pytest.fail(
            "these tests need a real Redis: none answers at 127.0.0.1:6379 and redis-server is "
            "not installed (apt-get install redis-server, or set LORAPLEX_TEST_REDIS_URL)"
        )
    return found


class RedisProcess:
    """A throwaway redis-server on 127.0.0.1 with no persistence, in its own directory.

    The port is chosen at the first ``start`` and kept, so ``kill`` then ``start`` is a restart
    that clients see at the same URL (with an empty dataset and script cache).
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        assert self.port is not None, "start() first"
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self._proc is None, "already running"
        binary = redis_server_binary()
        # A free port can be taken between the probe and the bind; pick another then.
        for _ in range(5):
            port = self.port or free_port()
            if self._launch(binary, port):
                self.port = port
                return
            if self.port is not None:
                break
        log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
        pytest.fail(f"redis-server did not start on port {self.port or port}:\n{log}")

    def kill(self) -> None:
        """Stop at once (SIGKILL), as a crash would."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None

    def _launch(self, binary: str, port: int) -> bool:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.workdir / "redis.log"),
        ]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            if redis_answers("127.0.0.1", port):
                self._proc = proc
                return True
            time.sleep(0.02)
        proc.kill()
        proc.wait(timeout=10)
        return False


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis shared by the session's tests (isolate with ``redis_key_prefix``)."""
    configured = os.environ.get("LORAPLEX_TEST_REDIS_URL")
    if configured:
        yield configured
        return
    if redis_answers(*MACHINE_REDIS):
        yield f"redis://{MACHINE_REDIS[0]}:{MACHINE_REDIS[1]}/0"
        return
    server = RedisProcess(tmp_path_factory.mktemp("redis-session"))
    server.start()
    try:
        yield server.url
    finally:
        server.kill()


@pytest.fixture
def redis_key_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix no other test uses; every key under it is deleted after the test."""
    prefix = f"lpxtest-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def redis_process(tmp_path: Path) -> Iterator[RedisProcess]:
    """A private redis-server for one test (started); killed at the end."""
    server = RedisProcess(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.kill()
