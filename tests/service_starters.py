"""Throwaway servers for tests on machines that run none: PostgreSQL.

A missing server is never a reason to skip a test. When no PostgreSQL answers, ``start_postgres``
runs one from the machine's binaries (``initdb`` + ``pg_ctl`` from PATH, /usr/local/bin or
/usr/lib/postgresql/<version>/bin; as root, Debian's ``postgresql`` package is installed first
if none is found) in a temporary directory, on a free port, with trust auth for ``postgres``,
and deletes it all when stopped. ``initdb`` refuses to run as root, so as root the server runs
as the ``postgres`` system user (created if missing).

Outage tests take the server away under a running gateway and bring it back, on the same port
and data: ``halt()`` / ``resume()`` (a stopped server: connections refused) and ``pause()`` /
``unpause()`` (SIGSTOP on every server process: connections hang).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_PG_USER = "postgres"


@dataclass
class PostgresServer:
    """A server started by ``start_postgres``; ``url`` names no database (add ``/dbname``)."""

    url: str
    data_dir: Path
    _bin_dir: Path
    _run_as: str | None
    _options: str = ""

    def halt(self) -> None:
        """Stop the server at once, keeping its data (``resume`` starts it again)."""
        pg_ctl = [str(self._bin_dir / "pg_ctl"), "-D", str(self.data_dir)]
        _run(self._run_as, [*pg_ctl, "-m", "immediate", "stop"])

    def resume(self) -> None:
        """Start a halted server again on the same port and data (nothing if it runs)."""
        if (self.data_dir / "postmaster.pid").exists():
            return
        log = str(self.data_dir.parent / "server.log")
        pg_ctl = [str(self._bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-l", log]
        _run(self._run_as, [*pg_ctl, "-w", "-t", "60", "-o", self._options, "start"])

    def pause(self) -> None:
        """SIGSTOP the postmaster and every backend: the port accepts, nothing answers."""
        for pid in self._pids():
            os.kill(pid, signal.SIGSTOP)

    def unpause(self) -> None:
        for pid in self._pids():
            os.kill(pid, signal.SIGCONT)

    def _pids(self) -> list[int]:
        postmaster = int((self.data_dir / "postmaster.pid").read_text().split()[0])
        children = subprocess.run(
            ["pgrep", "-P", str(postmaster)], capture_output=True, text=True, check=False
        ).stdout.split()
        return [postmaster, *(int(pid) for pid in children)]

    def stop(self) -> None:
        """Stop the server at once (no checkpoint: its data is thrown away) and delete its files."""
        try:
            pg_ctl = [str(self._bin_dir / "pg_ctl"), "-D", str(self.data_dir)]
            _run(self._run_as, [*pg_ctl, "-m", "immediate", "stop"])
        finally:
            shutil.rmtree(self.data_dir.parent, ignore_errors=True)


def port_open(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def find_postgres_bin() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``, newest major version first."""
    candidates: list[Path] = []
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    candidates.append(Path("/usr/local/bin"))
    installed = Path("/usr/lib/postgresql").glob("*/bin")
    candidates += sorted(
        installed, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0, reverse=True
    )
    for directory in candidates:
        if (directory / "initdb").exists() and (directory / "pg_ctl").exists():
            return directory
    return None


def start_postgres() -> PostgresServer:
    """Start a throwaway PostgreSQL on 127.0.0.1 and a free port; ``RuntimeError`` if impossible."""
    bin_dir = find_postgres_bin()
    if bin_dir is None:
        _install_postgres()
        bin_dir = find_postgres_bin()
        if bin_dir is None:
            raise RuntimeError("PostgreSQL was installed but initdb/pg_ctl are still not found")
    run_as = _server_user()
    root = Path(tempfile.mkdtemp(prefix="loraplex-pg-"))
    data_dir = root / "data"
    if run_as is not None:
        entry = pwd.getpwnam(run_as)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    initdb = [str(bin_dir / "initdb"), "-D", str(data_dir), "-U", _PG_USER, "-A", "trust", "-E", "UTF8"]
    _run(run_as, [*initdb, "--no-sync", "--no-instructions"])
    port = _free_port()
    # Durability is pointless for data thrown away at the end: no fsync makes every test faster.
    options = f"-p {port} -c listen_addresses=127.0.0.1 -k {root} -c fsync=off -c full_page_writes=off"
    pg_ctl = [str(bin_dir / "pg_ctl"), "-D", str(data_dir), "-l", str(root / "server.log")]
    _run(run_as, [*pg_ctl, "-w", "-t", "60", "-o", options, "start"])
    return PostgresServer(
        f"postgresql+asyncpg://{_PG_USER}@127.0.0.1:{port}", data_dir, bin_dir, run_as, options
    )


def _server_user() -> str | None:
    if os.geteuid() != 0:
        return None  # initdb runs as whoever we are
    try:
        pwd.getpwnam(_PG_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", _PG_USER], check=True
        )
    return _PG_USER


def _install_postgres() -> None:
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(
            "no PostgreSQL answers on 127.0.0.1:5432 and no initdb/pg_ctl was found: install PostgreSQL "
            "(Debian: apt-get install postgresql) or set LORAPLEX_TEST_POSTGRES_URL"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "postgresql"], check=True, env=env)


def _run(run_as: str | None, argv: Sequence[str]) -> None:
    command = list(argv) if run_as is None else ["runuser", "-u", run_as, "--", *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd="/")
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
