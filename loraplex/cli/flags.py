"""Command-line options made from the settings: one ``--flag`` per setting, help from its docstring.

``settings_options()`` gives the parameters of a typer command (an ``inspect.Signature``),
grouped in panels by section: every setting of ``ServerSettings`` becomes ``--<name-with-dashes>``
(booleans ``--x / --no-x``, lists repeatable, sizes in bytes with units such as ``2GiB``).
Every default is None, meaning "not given", so the environment, the config file and then the
setting's own default apply (``loraplex.platform.settings.loader``). Values stay strings here;
the settings model converts and checks them, with one error format whatever their source.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

import typer

from loraplex.platform.settings import SettingField, all_fields


def _help(field: SettingField) -> str:
    parts = [field.doc or field.name]
    default = "unset" if field.default is None and field.default_text == "None" else field.default_text
    if field.is_secret:
        default = "unset"
    doc = (field.doc or "").lower()
    says_default = any(m in doc for m in ("default:", "(default ", "; default ", "none =", "none leaves"))
    if default in ("unset", "(computed)") and says_default:
        # The docstring says what an unset value means ("default: data_dir/adapters"): saying
        # "default unset" after it would contradict it.
        parts.append(f"(env {field.env})")
        return " ".join(parts)
    # Parentheses, not brackets: the help is rich markup, where [...] is a style tag.
    parts.append(f"(env {field.env}; default {default})")
    return " ".join(parts)


def _metavar(field: SettingField) -> str:
    if field.is_bytes:
        return "BYTES"
    if field.choices:
        return "[" + "|".join(field.choices) + "]"
    tp = field.base_type
    return {int: "INT", float: "FLOAT"}.get(tp, "TEXT")


def _option(field: SettingField) -> inspect.Parameter:
    panel = f"{field.section} settings"
    annotation: Any
    if field.is_bool:
        opt = typer.Option(
            f"{field.flag}/--no-{field.flag[2:]}",
            help=_help(field),
            rich_help_panel=panel,
            show_default=False,
        )
        annotation = Annotated[bool | None, opt]
    elif field.is_list:
        opt = typer.Option(
            field.flag, help=_help(field), rich_help_panel=panel, show_default=False, metavar="TEXT"
        )
        annotation = Annotated[list[str] | None, opt]
    else:
        opt = typer.Option(
            field.flag, help=_help(field), rich_help_panel=panel, show_default=False, metavar=_metavar(field)
        )
        annotation = Annotated[str | None, opt]
    return inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


def settings_options(names: Iterable[str] | None = None) -> list[inspect.Parameter]:
    """One option per setting (all of them, or ``names``), for a command's signature."""
    fields = all_fields()
    chosen = fields.values() if names is None else [fields[n] for n in names]
    return [_option(f) for f in chosen]


def given(values: dict[str, Any]) -> dict[str, Any]:
    """The options a user passed (None = left out; an empty repeatable option counts as left out)."""
    return {k: v for k, v in values.items() if v is not None and v != []}


def spread_list_options(argv: Sequence[str], names: Iterable[str]) -> list[str]:
    """``--lora-modules a=x b=y --port 1`` -> ``--lora-modules a=x --lora-modules b=y --port 1``.

    vLLM's ``--lora-modules`` takes several values after one flag; click options take one value
    per occurrence, so the values after such a flag are spread over repeated flags.
    """
    flags = {"--" + n.replace("_", "-") for n in names}
    out: list[str] = []
    current: str | None = None
    for arg in argv:
        if arg in flags:
            current = arg
            continue
        if current is not None and not arg.startswith("-"):
            out += [current, arg]
            continue
        current = None
        out.append(arg)
    return out
