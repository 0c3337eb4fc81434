"""``ServerSettings``: every setting of ``loraplex serve``, in five sections, validated together.

    ServerSettings(serving=..., engine=..., limits=..., gateway=..., process=...)
    ServerSettings(max_num_seqs=8, redis_url="redis://...")   # flat names are routed to their section

Each setting name is unique across the sections, so one name is the field, the flag
(``--max-num-seqs``), the environment variable (``LORAPLEX_MAX_NUM_SEQS``) and the TOML key
(``max_num_seqs`` in ``[engine]``, or at the top level). Sizes in bytes take units (``2GiB``)
wherever they come from. Reading flags, the environment and the file is ``loader``'s job;
this class is the validated value the server is built from.

Refused when built (``ValidationError`` naming the setting and the fix), unless single-tenant:

| setting | refused |
|---|---|
| ``auth="open"`` | on a host that is not a loopback address (anyone could call as ``local``) |
| no ``admin_token`` | on a host that is not a loopback address (the admin API would be open or dead) |
| ``admin_token`` | shorter than 16 characters, or a well-known placeholder (``changeme``, ...) |
| ``metrics_port`` | equal to ``port`` |
"""

from __future__ import annotations

import dataclasses
import ipaddress
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.model.source import model_display_name
from loraplex.platform.settings.fields import SettingField, section_fields
from loraplex.platform.settings.sections import (
    GatewaySettings,
    ProcessSettings,
    ServerLimits,
    ServingSettings,
)
from loraplex.platform.settings.units import parse_bytes

SECTIONS: dict[str, type] = {
    "serving": ServingSettings,
    "engine": EngineConfig,
    "limits": ServerLimits,
    "gateway": GatewaySettings,
    "process": ProcessSettings,
}
"""Section name -> the class of its values, in the order flags and tables list them."""

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` only accepts connections from this machine."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve to anything
        return False


@cache
def all_fields() -> dict[str, SettingField]:
    """Every setting by name (names are unique across sections; checked here)."""
    out: dict[str, SettingField] = {}
    for section, cls in SECTIONS.items():
        for f in section_fields(section, cls):
            if f.name in out or f.name in SECTIONS or f.name == "config_file":
                raise AssertionError(f"setting {f.name!r} of [{section}] is also in [{out[f.name].section}]")
            out[f.name] = f
    return out


def route(values: dict[str, Any], where: str) -> dict[str, Any]:
    """Flat and sectioned values -> ``{section: {name: value}}``; byte sizes parsed; an unknown
    name is a ValueError naming ``where`` it came from and the known names."""
    known = all_fields()
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key == "config_file":
            out[key] = value
        elif key in SECTIONS:
            if not isinstance(value, dict):
                out[key] = value  # an already built section object
                continue
            for name, item in value.items():
                field = known.get(name)
                if field is None or field.section != key:
                    raise ValueError(
                        f"{where}: [{key}] has no setting {name!r}; its settings: "
                        f"{sorted(f.name for f in known.values() if f.section == key)}"
                    )
                out.setdefault(key, {})[name] = _normalise(field, item)
        elif key in known:
            field = known[key]
            out.setdefault(field.section, {})[key] = _normalise(field, value)
        else:
            raise ValueError(f"{where}: unknown setting {key!r}; known: {sorted(known)}")
    return out


def _normalise(field: SettingField, value: Any) -> Any:
    if field.is_bytes and isinstance(value, str | float):
        try:
            return parse_bytes(value)
        except ValueError as exc:
            raise ValueError(f"{field.name}: {exc}") from None
    return value


class ServerSettings(BaseModel):
    """The validated settings of one server (see the module docstring)."""

    # hide_input_in_errors: a rejected admin_token must not be echoed into a log or a terminal.
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    config_file: Path | None = None
    """The TOML file these settings were read from, if any."""
    serving: ServingSettings = Field(default_factory=ServingSettings)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    limits: ServerLimits = Field(default_factory=ServerLimits)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    process: ProcessSettings = Field(default_factory=ProcessSettings)

    @model_validator(mode="before")
    @classmethod
    def _route_flat_names(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return route(data, "settings")

    @model_validator(mode="after")
    def _safe_binding(self) -> ServerSettings:
        host, gateway = self.serving.host, self.gateway
        if self.serving.single_tenant or is_loopback(host):
            return self
        if gateway.auth == "open":
            raise ValueError(
                f"auth='open' serves every caller as tenant 'local', so it is accepted only on a loopback "
                f"host (127.0.0.1, ::1, localhost), not {host!r}; use auth='keys' to serve the network"
            )
        if gateway.admin_token is None:
            raise ValueError(
                f"host {host!r} is reachable from other machines: set admin_token "
                "(LORAPLEX_ADMIN_TOKEN) to protect the admin API, or bind 127.0.0.1"
            )
        return self

    @model_validator(mode="after")
    def _lora_modules_need_single_tenant(self) -> ServerSettings:
        if self.serving.lora_modules and not self.serving.single_tenant:
            raise ValueError(
                "lora_modules needs single_tenant (--single-tenant); with tenants, upload adapters with "
                "POST /v1/adapters or `loraplex adapters upload`"
            )
        return self

    @model_validator(mode="after")
    def _metrics_port_of_its_own(self) -> ServerSettings:
        if self.serving.metrics_port is not None and self.serving.metrics_port == self.serving.port:
            raise ValueError(
                f"metrics_port {self.serving.metrics_port} is also the serving port: the metrics listener "
                "needs a port of its own (e.g. 9090), or unset metrics_port"
            )
        return self

    # -- derived values ----------------------------------------------------------------
    @property
    def served_model_name(self) -> str:
        """The model id clients send: ``served_model_name``, else the model's folder or file name."""
        return self.serving.served_model_name or model_display_name(self.engine.model)

    def engine_config(self) -> EngineConfig:
        """The engine's config as the server runs it: LoRA on for the gateway (tenants upload
        adapters) and for ``lora_modules``."""
        needs_lora = bool(self.serving.lora_modules) or not self.serving.single_tenant
        if needs_lora and not self.engine.enable_lora:
            return dataclasses.replace(self.engine, enable_lora=True)
        return self.engine

    def value(self, name: str) -> Any:
        """The value of the setting ``name`` (any section)."""
        return getattr(getattr(self, all_fields()[name].section), name)
