"""Write the server's settings into the Helm chart, so its values cannot drift from the settings model.

    python scripts/chart_settings.py           rewrite helm/loraplex/values.yaml's `config` block
                                               and values.schema.json's `config` schema
    python scripts/chart_settings.py --check   exit 1 when either is out of date (tests/deploy runs it)

Every setting of ``loraplex/platform/settings/`` is a chart value: a key of ``config`` (the TOML
key; the chart passes it as ``LORAPLEX_<NAME>``), or one of ``MANAGED``, which the chart sets from
its own structured values (the listening address, the mounted folders, the secrets). The schema
lists each ``config`` key with its type and ``additionalProperties: false``, so a misspelt or
removed setting fails ``helm lint`` / ``helm template`` instead of being ignored.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loraplex.platform.settings import SettingField, all_fields  # noqa: E402

CHART = ROOT / "helm" / "loraplex"
VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"
BEGIN, END = "# >>> settings (generated)\n", "# <<< settings (generated)\n"

MANAGED: dict[str, str] = {
    "host": "0.0.0.0, so the Service reaches the pod",
    "port": "containerPort",
    "data_dir": "/var/lib/loraplex, an emptyDir (state that matters lives in the database and adapter store)",
    "adapter_store": "the adapterStore volume's mount, /var/lib/loraplex-adapters",
    "disk_kv_path": "kvCache.disk: the volume's mount, /var/lib/loraplex-kv",
    "cache": "the cache volume's mount, /var/cache/loraplex (the image's default too)",
    "admin_token": "the Secret (adminToken, or existingSecret)",
    "database_url": "the Secret (database.url, existingSecret, or the in-chart postgresql)",
    "redis_url": "the Secret (redis.url, existingSecret, or the in-chart redisTrial)",
    "metrics_port": "metricsPort",
    "kv_events_config": "router.kvEvents: PUB and replay ports, the topic with the pod's IP, the encoding",
}
"""Settings the chart sets itself, and from what (they are not keys of ``config``)."""


def config_fields() -> list[SettingField]:
    """The settings that are keys of ``config``: all but ``MANAGED``, in the sections' order."""
    return [f for name, f in all_fields().items() if name not in MANAGED]


def _json_type(field: SettingField) -> dict[str, Any]:
    tp = field.base_type
    if field.choices is not None:
        return {"enum": [*field.choices, None]}
    if field.is_bool:
        return {"type": ["boolean", "null"]}
    if field.is_bytes:  # units allowed: "2GiB"
        return {"type": ["integer", "string", "null"]}
    if tp is int:
        return {"type": ["integer", "null"]}
    if tp is float:
        return {"type": ["number", "null"]}
    if field.is_list:
        return {"type": ["array", "string", "null"], "items": {"type": "string"}}
    if typing.get_origin(tp) is None and isinstance(tp, type) and issubclass(tp, str | Path):
        return {"type": ["string", "null"]}
    raise TypeError(f"setting {field.name}: no JSON type for {tp!r}; extend scripts/chart_settings.py")


def config_schema() -> dict[str, Any]:
    """The JSON schema of ``config``."""
    return {
        "type": "object",
        "description": "The server's settings by TOML key (null: the server's default).",
        "additionalProperties": False,
        "properties": {f.name: {**_json_type(f), "description": f.doc} for f in config_fields()},
    }


def config_block() -> str:
    """The ``config`` block of values.yaml, between the markers."""
    lines = ["config:"]
    section = ""
    for f in config_fields():
        if f.section != section:
            section = f.section
            lines.append(f"  # -- [{section}]")
        doc = f"{f.doc} (default: {f.default_text})" if f.doc else f"(default: {f.default_text})"
        lines += textwrap.wrap(doc, 98, initial_indent="  # ", subsequent_indent="  # ")
        lines.append(f"  {f.name}: null")
    lines.append("# Set by the chart, not in config:")
    lines += [f"#   {name}: {how}" for name, how in MANAGED.items()]
    return "\n".join(lines) + "\n"


def render_values(text: str) -> str:
    """``text`` (values.yaml) with the generated block replaced."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + config_block() + text[end:]


def render_schema(text: str) -> str:
    """``text`` (values.schema.json) with ``properties.config`` replaced."""
    schema = json.loads(text)
    schema["properties"]["config"] = config_schema()
    return json.dumps(schema, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether the files are current")
    args = parser.parse_args(argv)
    stale = []
    for path, render in ((VALUES, render_values), (SCHEMA, render_schema)):
        old = path.read_text()
        new = render(old)
        if new != old:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
        print(
            f"{names}: out of date with the settings; run python scripts/chart_settings.py", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
