"""The operators' CLI (``loraplex tenants|keys|adapters``) on the gateway's database and store."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from support.adapters import make_small_adapter

from loraplex.cli import main
from loraplex.platform.api.services import keys
from loraplex.storage.db import Database, Tenant


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def authenticate(database_url: str, key: str) -> Tenant | None:
    async def check() -> Tenant | None:
        db = Database(database_url)
        try:
            async with db.transaction() as session:
                return await keys.authenticate(session, key)
        finally:
            await db.dispose()

    return asyncio.run(check())


@pytest.mark.slow
def test_tenants_keys_and_adapters(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tiny_dirs: dict[str, Path],
) -> None:
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    store = tmp_path / "store"
    monkeypatch.setenv("LORAPLEX_ADAPTER_STORE", str(store))

    # Settings as options of the group, or from the environment: the same names.
    assert run(capsys, "tenants", "--database-url", database_url, "create", "acme", "--rpm", "5")[0] == 0
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", database_url)
    code, _, err = run(capsys, "tenants", "create", "acme")
    assert code == 1 and "already exists" in err
    assert run(capsys, "tenants", "list")[1].split() == ["acme", "enabled", "5", "-", "-", "-", "-", "1"]
    # The fair-share weight: set at creation, changed with update (quotas given there change too).
    assert run(capsys, "tenants", "create", "globex", "--weight", "3")[0] == 0
    assert run(capsys, "tenants", "update", "acme", "--weight", "2.5", "--tpm", "100")[0] == 0
    assert run(capsys, "tenants", "list")[1].splitlines() == [
        "\t".join(["acme", "enabled", "5", "100", "-", "-", "-", "2.5"]),
        "\t".join(["globex", "enabled", "-", "-", "-", "-", "-", "3"]),
    ]
    code, _, err = run(capsys, "tenants", "update", "acme", "--weight", "0")
    assert code == 1 and "weight" in err
    code, _, err = run(capsys, "tenants", "update", "nobody", "--weight", "2")
    assert code == 1 and "nobody" in err

    code, out, _ = run(capsys, "keys", "create", "acme", "--name", "ops")
    key = out.strip()
    assert code == 0 and key.startswith("lpx-")
    tenant = authenticate(database_url, key)
    assert tenant is not None and tenant.name == "acme"
    listed = run(capsys, "keys", "list", "acme")[1]
    assert key[:12] in listed and key not in listed
    key_id = listed.split()[0]
    assert run(capsys, "keys", "revoke", key_id)[0] == 0
    assert authenticate(database_url, key) is None

    base = tiny_dirs["gqa_tied"]
    good = make_small_adapter(base, tmp_path / "good", rank=4)
    model = ["--model", str(base), "--max-lora-rank", "8"]
    code, out, err = run(
        capsys, "adapters", "upload", "acme", "fr", str(good), *model, "--visibility", "public"
    )
    assert code == 0, err
    version = out.split()[-1]
    assert (store / version / "adapter_model.safetensors").is_file()
    too_big = make_small_adapter(base, tmp_path / "big", rank=16)
    code, _, err = run(capsys, "adapters", "upload", "acme", "big", str(too_big), *model)
    assert code == 1 and "rank_too_large" in err
    assert sorted(p.name for p in store.iterdir()) == [version]
    row = run(capsys, "adapters", "list")[1].split()
    assert row[:5] == ["acme", "fr", version, "public", "4"] and int(row[5]) > 0
    assert run(capsys, "adapters", "delete", "acme", "fr")[0] == 0
    assert not (store / version).exists()
    assert run(capsys, "adapters", "list")[1] == ""

    assert run(capsys, "tenants", "disable", "acme")[0] == 0
    assert run(capsys, "tenants", "list")[1].split()[:2] == ["acme", "disabled"]


def test_serve_flags_are_the_settings_names(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("LORAPLEX_HOST", "LORAPLEX_ADMIN_TOKEN", "LORAPLEX_CONFIG_FILE", "LORAPLEX_AUTH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LORAPLEX_QUOTA_WINDOW_S", "7")
    code, out, _ = run(
        capsys,
        "serve",
        "--print-settings",
        "--redis-url",
        "redis://r:6379/0",
        "--auth",
        "open",
        "--max-upload-bytes",
        "4096",
    )
    assert code == 0
    settings = {line.split()[1]: line.split()[2] for line in out.splitlines()[1:]}
    assert (settings["redis_url"], settings["auth"], settings["max_upload_bytes"]) == (
        "redis://r:6379/0",
        "open",
        "4KiB",  # 4096 bytes, shown in the largest exact unit
    )
    assert settings["quota_window_s"] == "7.0"  # a flag left out falls back to the environment
    assert run(capsys, "serve", "--print-settings", "--auth", "everyone")[0] == 2
    code, _, err = run(capsys, "serve", "--print-settings", "--host", "0.0.0.0")
    assert code == 2 and "admin_token" in err


def test_an_unreachable_database_is_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    """No traceback and no hang: the database's name, why, exit code 1."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql+asyncpg://postgres@127.0.0.1:{port}/nothing"
    code, out, err = run(capsys, "tenants", "--database-url", url, "list")
    assert code == 1 and out == ""
    assert "metadata database is unreachable" in err and "Traceback" not in err, err
