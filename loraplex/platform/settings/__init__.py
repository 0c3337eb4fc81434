"""The server's settings: one model, five sections, read from flags, the environment and a TOML file.

| module | owns |
|---|---|
| ``server`` | ``ServerSettings``: the sections validated together, flat names routed, derived values |
| ``sections`` | ``ServingSettings``, ``GatewaySettings``, ``ServerLimits``, ``ProcessSettings`` |
| ``loader`` | ``load_settings``: flags > ``LORAPLEX_<NAME>`` > the config file > defaults, with each source |
| ``fields`` | ``SettingField``: every setting described once (flags, env names, the settings table) |
| ``units`` | byte sizes with units (``2GiB``) for every ``*_bytes`` / ``*_memory`` setting |

It sits between the HTTP layer and the engine: it imports the engine's config (the ``engine``
section, ``EngineConfig``), and the API and the CLI import it.
"""

from loraplex.platform.settings.fields import ENV_PREFIX, SettingField
from loraplex.platform.settings.loader import CONFIG_FILE_ENV, LoadedSettings, load_settings
from loraplex.platform.settings.sections import (
    AuthMode,
    FailurePolicy,
    GatewaySettings,
    LogLevel,
    ProcessSettings,
    ServerLimits,
    ServingSettings,
    default_data_dir,
)
from loraplex.platform.settings.server import SECTIONS, ServerSettings, all_fields, is_loopback
from loraplex.platform.settings.units import format_bytes, parse_bytes

__all__ = [
    "CONFIG_FILE_ENV",
    "ENV_PREFIX",
    "SECTIONS",
    "AuthMode",
    "FailurePolicy",
    "GatewaySettings",
    "LoadedSettings",
    "LogLevel",
    "ProcessSettings",
    "ServerLimits",
    "ServerSettings",
    "ServingSettings",
    "SettingField",
    "all_fields",
    "default_data_dir",
    "format_bytes",
    "is_loopback",
    "load_settings",
    "parse_bytes",
]
