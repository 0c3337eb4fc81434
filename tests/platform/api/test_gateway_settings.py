"""``GatewaySettings``: one name per setting (field, env, config file), and unsafe bindings refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from loraplex.platform.api.settings import GatewaySettings, is_loopback

TOKEN = "a-real-admin-token-of-32-characters"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("LORAPLEX_"):
            monkeypatch.delenv(name)


def test_defaults_live_in_the_data_dir(tmp_path: Path) -> None:
    s = GatewaySettings(data_dir=tmp_path)
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
    s = GatewaySettings()
    assert (s.redis_url, s.quota_window_s, s.auth) == ("redis://env:6379/0", 5.0, "open")
    assert GatewaySettings(redis_url="redis://flag:6379/0").redis_url == "redis://flag:6379/0"
    monkeypatch.setenv("LORAPLEX_ADMIN_TOKEN", TOKEN)
    assert GatewaySettings().admin_token is not None
    assert TOKEN not in repr(GatewaySettings())


def test_unknown_keys_in_the_config_file_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('redis_ulr = "redis://typo"\n')
    with pytest.raises(ValueError, match="redis_ulr"):
        GatewaySettings(config_file=config)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "example.com"])
def test_non_loopback_hosts_need_an_admin_token_and_refuse_open_auth(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(ValidationError, match="admin_token"):
        GatewaySettings(host=host)
    with pytest.raises(ValidationError, match="loopback"):
        GatewaySettings(host=host, auth="open", admin_token=TOKEN)
    assert GatewaySettings(host=host, admin_token=TOKEN).host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost", "[::1]"])
def test_loopback_hosts_allow_open_auth_without_a_token(host: str) -> None:
    assert GatewaySettings(host=host, auth="open").auth == "open"


@pytest.mark.parametrize("token", ["changeme", "secret", "short-token"])
def test_placeholder_or_short_admin_tokens_are_refused(token: str) -> None:
    with pytest.raises(ValidationError, match="admin_token must be a real secret"):
        GatewaySettings(admin_token=token)
