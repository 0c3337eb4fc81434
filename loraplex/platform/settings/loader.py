"""Reading ``ServerSettings`` from flags, the environment and a TOML file, and saying where each
value came from.

Precedence, highest first: flags (values passed in), ``LORAPLEX_<NAME>`` environment
variables, the config file (``--config-file`` or ``LORAPLEX_CONFIG_FILE``), the defaults.
The file holds one table per section, or flat keys (names are unique)::

    [engine]
    kv_cache_memory = "1GiB"
    max_num_seqs = 64

    [gateway]
    database_url = "postgresql+asyncpg://loraplex@db/loraplex"

An unknown key or variable name is an error (a typo must not fall back to a default); an
empty environment variable counts as unset. ``load_settings`` returns the settings and, for
each one, its source (``flag``, ``env``, ``file`` or ``default``), which ``--print-settings``
shows.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from loraplex.platform.settings.fields import ENV_PREFIX
from loraplex.platform.settings.server import SECTIONS, ServerSettings, all_fields, route

CONFIG_FILE_ENV = ENV_PREFIX + "CONFIG_FILE"


class _Values(PydanticBaseSettingsSource):
    """A source that hands pydantic-settings the sectioned values read by one of the readers below."""

    def __init__(self, settings_cls: type[BaseSettings], values: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self.values = values

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ returns everything at once

    def __call__(self) -> dict[str, Any]:
        return self.values


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings set in ``environ`` as ``LORAPLEX_<NAME>`` (empty values are unset)."""
    return {name: environ[f.env] for name, f in all_fields().items() if environ.get(f.env, "") != ""}


def read_config_file(path: Path) -> dict[str, Any]:
    """The sectioned values of a TOML settings file; ValueError for an unreadable file or unknown key."""
    try:
        values = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read the config file {path}: {exc}") from exc
    return route(values, f"config file {path}")


def _flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in flags.items() if v is not None}


@dataclass(frozen=True)
class LoadedSettings:
    """Settings and where each came from."""

    settings: ServerSettings
    sources: dict[str, str]
    """Setting name -> ``flag`` / ``env`` / ``file`` / ``default``."""


def load_settings(
    flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> LoadedSettings:
    """Flags (flat names; None = not given) over ``LORAPLEX_*`` over the config file over defaults.

    Raises pydantic's ``ValidationError`` (or ``ValueError`` for the file) naming the setting.
    """
    given = _flags(flags or {})
    env_values = read_env(os.environ if environ is None else environ)
    config_file = given.get("config_file") or (os.environ if environ is None else environ).get(
        CONFIG_FILE_ENV
    )
    path = Path(config_file) if config_file else None
    file_values = read_config_file(path) if path is not None else {}
    layers = [
        ("flag", route(given, "flags")),
        ("env", route(env_values, "environment")),
        ("file", file_values),
    ]

    class _Loader(ServerSettings, BaseSettings):
        model_config = SettingsConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return tuple(_Values(settings_cls, values) for _, values in layers)

    loaded = _Loader(config_file=path)
    settings = ServerSettings.model_validate(
        {
            "config_file": path,
            **{name: getattr(loaded, name) for name in SECTIONS},
        }
    )
    sources: dict[str, str] = {}
    for name, field in all_fields().items():
        sources[name] = next(
            (where for where, values in layers if name in values.get(field.section, {})), "default"
        )
    return LoadedSettings(settings, sources)
