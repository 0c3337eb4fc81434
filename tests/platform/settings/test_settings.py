"""``ServerSettings`` and ``load_settings``: one name per setting (field, flag, env, file key),
precedence flags > env > file > defaults, units everywhere, unsafe bindings refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from loraplex.cli import main
from loraplex.platform.settings import ServerSettings, all_fields, is_loopback, load_settings

TOKEN = "a-real-admin-token-of-32-characters"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("LORAPLEX_"):
            monkeypatch.delenv(name)


def test_defaults_live_in_the_data_dir(tmp_path: Path) -> None:
    s = ServerSettings(data_dir=tmp_path).gateway
    assert s.database_url_or_default == f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    assert s.adapter_store_dir == tmp_path / "adapters"
    assert (s.auth, s.redis_url, s.admin_token, s.quota_failure_policy) == ("keys", None, None, "fail_closed")


def test_env_overrides_the_config_file_and_flags_override_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('redis_url = "redis://file:6379/0"\nquota_window_s = 5.0\nauth = "open"\n')
    monkeypatch.setenv("LORAPLEX_CONFIG_FILE", str(config))
    monkeypatch.setenv("LORAPLEX_REDIS_URL", "redis://env:6379/0")
    s = load_settings().settings.gateway
    assert (s.redis_url, s.quota_window_s, s.auth) == ("redis://env:6379/0", 5.0, "open")
    assert (
        load_settings({"redis_url": "redis://flag:6379/0"}).settings.gateway.redis_url
        == "redis://flag:6379/0"
    )
    monkeypatch.setenv("LORAPLEX_ADMIN_TOKEN", TOKEN)
    assert load_settings().settings.gateway.admin_token is not None
    assert TOKEN not in repr(load_settings().settings)


def test_unknown_keys_in_the_config_file_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('redis_ulr = "redis://typo"\n')
    with pytest.raises(ValueError, match="redis_ulr"):
        load_settings({"config_file": str(config)})
    config.write_text('[engine]\nredis_url = "redis://wrong-section"\n')
    with pytest.raises(ValueError, match=r"\[engine\] has no setting 'redis_url'"):
        load_settings({"config_file": str(config)})


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "example.com"])
def test_non_loopback_hosts_need_an_admin_token_and_refuse_open_auth(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(ValidationError, match="admin_token"):
        ServerSettings(host=host)
    with pytest.raises(ValidationError, match="loopback"):
        ServerSettings(host=host, auth="open", admin_token=TOKEN)
    assert ServerSettings(host=host, admin_token=TOKEN).serving.host == host
    # Without tenants there is no admin API and no 'local' tenant to protect.
    assert ServerSettings(host=host, single_tenant=True).serving.host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost", "[::1]"])
def test_loopback_hosts_allow_open_auth_without_a_token(host: str) -> None:
    assert ServerSettings(host=host, auth="open").gateway.auth == "open"


@pytest.mark.parametrize("token", ["changeme", "secret", "short-token"])
def test_placeholder_or_short_admin_tokens_are_refused(token: str) -> None:
    with pytest.raises(ValidationError, match="admin_token must be a real secret"):
        ServerSettings(admin_token=token)


def test_every_section_reads_env_and_file_and_sizes_take_units(tmp_path: Path) -> None:
    """One setting per section from the environment and one from the file, in their tables."""
    config = tmp_path / "server.toml"
    config.write_text(
        '[serving]\nserved_model_name = "from-file"\n'
        '[engine]\nkv_cache_memory = "1GiB"\n'
        "[limits]\nmax_stop_strings = 3\n"
        '[gateway]\nquota_key_prefix = "file"\n'
    )
    environ = {
        "LORAPLEX_CONFIG_FILE": str(config),
        "LORAPLEX_PORT": "9123",
        "LORAPLEX_MAX_NUM_SEQS": "7",
        "LORAPLEX_MAX_N": "2",
        "LORAPLEX_MAX_UPLOAD_BYTES": "2GiB",
    }
    loaded = load_settings(environ=environ)
    s = loaded.settings
    assert (s.serving.port, s.serving.served_model_name) == (9123, "from-file")
    assert (s.engine.max_num_seqs, s.engine.kv_cache_memory) == (7, 1 << 30)
    assert (s.limits.max_n, s.limits.max_stop_strings) == (2, 3)
    assert (s.gateway.max_upload_bytes, s.gateway.quota_key_prefix) == (2 << 30, "file")
    assert {k: v for k, v in loaded.sources.items() if v != "default"} == {
        "port": "env",
        "served_model_name": "file",
        "max_num_seqs": "env",
        "kv_cache_memory": "file",
        "max_n": "env",
        "max_stop_strings": "file",
        "max_upload_bytes": "env",
        "quota_key_prefix": "file",
    }
    # A flag beats both; a value that breaks a rule names the setting.
    assert load_settings({"max_num_seqs": "5"}, environ=environ).settings.engine.max_num_seqs == 5
    with pytest.raises(ValidationError, match="max_num_seqs must be >= 1"):
        load_settings({"max_num_seqs": "0"}, environ=environ)
    with pytest.raises(ValueError, match="max_upload_bytes: not a byte size"):
        load_settings({"max_upload_bytes": "two gigs"})


def test_setting_names_are_unique_and_documented() -> None:
    fields = all_fields()
    assert {f.section for f in fields.values()} == {"serving", "engine", "limits", "gateway", "process"}
    undocumented = sorted(name for name, f in fields.items() if not f.doc)
    assert not undocumented, f"settings without a docstring (their flag would have no help): {undocumented}"
    assert fields["max_num_seqs"].env == "LORAPLEX_MAX_NUM_SEQS"
    assert fields["kv_cache_memory"].flag == "--kv-cache-memory"


def test_print_settings_shows_values_and_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "server.toml"
    config.write_text('[engine]\nkv_cache_memory = "1GiB"\n')
    monkeypatch.setenv("LORAPLEX_MAX_NUM_SEQS", "9")
    monkeypatch.setenv("LORAPLEX_ADMIN_TOKEN", TOKEN)
    code = main(["serve", "--print-settings", "--config-file", str(config), "--port", "8123"])
    out = capsys.readouterr().out
    assert code == 0
    rows = {line.split()[1]: line for line in out.splitlines()[1:]}
    assert rows["max_num_seqs"].split()[2:] == ["9", "env", "LORAPLEX_MAX_NUM_SEQS"]
    assert rows["kv_cache_memory"].split()[2:] == ["1GiB", "file", str(config)]
    assert rows["port"].split()[2:] == ["8123", "flag", "--port"]
    assert rows["block_size"].split()[2:] == ["16", "default"]
    assert TOKEN not in out and rows["admin_token"].split()[2] == "**********"
    assert len(rows) == len(all_fields())


def test_serve_refuses_bad_settings_with_the_setting_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--print-settings", "--max-num-seqs", "many"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    assert main(["serve", "--print-settings", "--auth", "everyone"]) == 2
    assert "auth" in capsys.readouterr().err
    assert main(["serve", "--print-settings", "--host", "0.0.0.0"]) == 2
    assert "admin_token" in capsys.readouterr().err
    assert main(["serve", "--print-settings", "--no-such-flag"]) == 2
    # vLLM's spelling: several NAME=PATH after one --lora-modules.
    assert main(["serve", "--print-settings", "--single-tenant", "--lora-modules", "a=/x", "b=/y"]) == 0
    assert "['a=/x', 'b=/y']" in capsys.readouterr().out


def test_overload_settings_and_the_fair_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = ServerSettings()
    assert (defaults.limits.max_queued_requests, defaults.limits.request_timeout_s) == (512, 600)
    assert defaults.engine.scheduling_policy == "fair"
    config = tmp_path / "s.toml"
    config.write_text('[limits]\nmax_queued_requests = 64\n[engine]\nscheduling_policy = "fcfs"\n')
    monkeypatch.setenv("LORAPLEX_CONFIG_FILE", str(config))
    monkeypatch.setenv("LORAPLEX_REQUEST_TIMEOUT_S", "0")  # no deadline
    s = load_settings().settings
    assert (s.limits.max_queued_requests, s.limits.request_timeout_s, s.engine.scheduling_policy) == (
        64,
        0,
        "fcfs",
    )
    with pytest.raises((ValidationError, ValueError), match="max_queued_requests"):
        ServerSettings(max_queued_requests=0)
