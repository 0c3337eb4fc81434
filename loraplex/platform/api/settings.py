"""``GatewaySettings``: every setting of the multi-tenant gateway, in one pydantic-settings class.

One name per setting everywhere: the field ``redis_url`` is the env variable
``LORAPLEX_REDIS_URL``, the key ``redis_url`` of the optional TOML config file and, in the
CLI, ``--redis-url``. Precedence, highest first: values passed in (CLI flags), the
environment, the config file (``config_file`` / ``LORAPLEX_CONFIG_FILE``), the defaults.

Refused when built (``ValidationError`` naming the field and the fix):

| setting | refused |
|---|---|
| ``auth="open"`` | on a host that is not a loopback address (anyone could call as ``local``) |
| no ``admin_token`` | on a host that is not a loopback address (the admin API would be open or dead) |
| ``admin_token`` | shorter than 16 characters, or a well-known placeholder (``changeme``, ...) |
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from loraplex.platform.api.quotas import FailurePolicy, QuotaSettings

AuthMode = Literal["keys", "open"]
ENV_PREFIX = "LORAPLEX_"
CONFIG_FILE_ENV = ENV_PREFIX + "CONFIG_FILE"
MIN_ADMIN_TOKEN_CHARS = 16
_PLACEHOLDER_TOKENS = frozenset({"changeme", "changethis", "admin", "secret", "password", "token", "test"})
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/loraplex``, else ``~/.local/share/loraplex``: state that must survive restarts
    (the gateway's database and adapter store), unlike ``loraplex.paths.cache_root``."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "loraplex"


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` only accepts connections from this machine."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve to anything
        return False


class _ConfigFileSource(PydanticBaseSettingsSource):
    """The TOML file named by ``config_file`` (passed in, or ``LORAPLEX_CONFIG_FILE``): flat keys,
    the field names. An unknown key is an error, so a typo never silently falls back to a default."""

    def __init__(self, settings_cls: type[BaseSettings], init_kwargs: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        given = init_kwargs.get("config_file") or os.environ.get(CONFIG_FILE_ENV)
        self.path = Path(given) if given else None

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads the whole file at once

    def __call__(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        try:
            values = tomllib.loads(self.path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"cannot read the config file {self.path}: {exc}") from exc
        unknown = sorted(set(values) - set(self.settings_cls.model_fields))
        if unknown:
            raise ValueError(
                f"config file {self.path}: unknown settings {unknown}; "
                f"known: {sorted(self.settings_cls.model_fields)}"
            )
        return values


class GatewaySettings(BaseSettings):
    """Settings of the multi-tenant gateway (``build_gateway``)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", frozen=True, use_attribute_docstrings=True
    )

    config_file: Path | None = None
    """TOML file with more of these settings (flat keys, the field names)."""
    host: str = "127.0.0.1"
    """Address the server binds."""
    port: int = Field(default=8000, ge=0, le=65535)
    """Port the server binds."""
    data_dir: Path = Field(default_factory=default_data_dir)
    """Where the default database and adapter store live."""
    database_url: str | None = None
    """SQLAlchemy URL of the metadata database (sqlite+aiosqlite:///... or postgresql+asyncpg://...);
    default: the SQLite file gateway.db in data_dir."""
    redis_url: str | None = None
    """Redis shared by every replica for quotas; unset: an in-process limiter (one replica)."""
    admin_token: SecretStr | None = None
    """Bearer token of the admin API (/admin/api); required on a non-loopback host."""
    adapter_store: Path | None = None
    """Folder of the content-addressed adapter store; default: data_dir/adapters."""
    auth: AuthMode = "keys"
    """keys: every /v1 call needs a tenant's API key; open: calls run as the built-in tenant
    'local' (loopback hosts only)."""
    quota_failure_policy: FailurePolicy = "fail_closed"
    """When Redis is unreachable: refuse limited requests (503), or admit them uncounted."""
    quota_window_s: float = Field(default=60.0, gt=0)
    """Length of the rpm / tpm sliding window in seconds."""
    quota_key_prefix: str = "lpx"
    """Prefix of the quota keys in Redis (several deployments can share one Redis)."""
    max_upload_bytes: int = Field(default=1 << 30, ge=1024)
    """Largest adapter upload (all files of one request together)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        init_kwargs = dict(getattr(init_settings, "init_kwargs", {}))
        return (init_settings, env_settings, _ConfigFileSource(settings_cls, init_kwargs))

    @field_validator("admin_token")
    @classmethod
    def _real_secret(cls, token: SecretStr | None) -> SecretStr | None:
        if token is None:
            return None
        value = token.get_secret_value()
        if value.strip().lower() in _PLACEHOLDER_TOKENS or len(value) < MIN_ADMIN_TOKEN_CHARS:
            raise ValueError(
                f"admin_token must be a real secret of at least {MIN_ADMIN_TOKEN_CHARS} characters, not a "
                'placeholder; generate one with: python -c "import secrets; print(secrets.token_urlsafe(32))"'
            )
        return token

    @model_validator(mode="after")
    def _safe_binding(self) -> GatewaySettings:
        if is_loopback(self.host):
            return self
        if self.auth == "open":
            raise ValueError(
                f"auth='open' serves every caller as tenant 'local', so it is accepted only on a loopback "
                f"host (127.0.0.1, ::1, localhost), not {self.host!r}; use auth='keys' to serve the network"
            )
        if self.admin_token is None:
            raise ValueError(
                f"host {self.host!r} is reachable from other machines: set admin_token "
                f"({ENV_PREFIX}ADMIN_TOKEN) to protect the admin API, or bind 127.0.0.1"
            )
        return self

    @property
    def database_url_or_default(self) -> str:
        """``database_url``, or the SQLite file ``gateway.db`` in ``data_dir``."""
        return self.database_url or f"sqlite+aiosqlite:///{self.data_dir / 'gateway.db'}"

    @property
    def adapter_store_dir(self) -> Path:
        """``adapter_store``, or ``data_dir/adapters``."""
        return self.adapter_store or self.data_dir / "adapters"

    def quota_settings(self) -> QuotaSettings:
        """The limiter's settings (the rest keep ``QuotaSettings``' defaults)."""
        return QuotaSettings(
            window_s=self.quota_window_s,
            failure_policy=self.quota_failure_policy,
            key_prefix=self.quota_key_prefix,
        )
