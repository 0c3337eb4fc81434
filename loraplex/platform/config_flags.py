"""Command-line flags derived from config dataclasses: one place for names, defaults and help.

Every field of a frozen config dataclass becomes ``--field-name`` (underscores to
dashes, vLLM's spelling), with the field's default, its type (``Literal`` fields
become choices, ``bool`` fields ``--x`` / ``--no-x``, ``*_memory`` / ``*_bytes`` fields
accept ``2GiB``) and, as help, the docstring written under the field. Adding a field
to ``EngineConfig`` or ``ServerLimits`` adds the flag; nothing is repeated by hand.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any, TypeVar

T = TypeVar("T")

_BYTE_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1e9', '4096' -> bytes."""
    low = text.strip().lower()
    try:
        for suffix, mult in _BYTE_UNITS.items():
            if low.endswith(suffix):
                return int(float(low[: -len(suffix)]) * mult)
        return int(float(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 2GiB, 512MiB or 1e9)") from None


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of ``cls`` (the string literal that follows it)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for prev, node in itertools.pairwise(body):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return tp, False


def _converter(name: str, tp: Any) -> Callable[[str], Any]:
    if tp is int and (name.endswith("_memory") or name.endswith("_bytes")):
        return parse_bytes
    if tp in (int, float, str):
        return typing.cast(Callable[[str], Any], tp)
    raise TypeError(f"config field {name!r} has type {tp!r}, which has no command-line form")


def add_config_flags(
    parser: argparse.ArgumentParser, cls: type, *, skip: Iterable[str] = (), title: str | None = None
) -> None:
    """Add one ``--flag`` per field of the dataclass ``cls`` (except ``skip``) to ``parser``."""
    group = parser.add_argument_group(title or cls.__name__)
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    skipped = set(skip)
    for f in dataclasses.fields(cls):
        if f.name in skipped or not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp, _ = _unwrap_optional(hints[f.name])
        help_text = docs.get(f.name, "")
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default}
        if tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text, **kwargs)
            continue
        if typing.get_origin(tp) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(tp))
        else:
            kwargs["type"] = _converter(f.name, tp)
            if kwargs["type"] is parse_bytes:
                kwargs["metavar"] = "BYTES"
        group.add_argument(flag, help=help_text, **kwargs)


def config_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Build ``cls`` from the parsed flags ``add_config_flags`` added, plus ``overrides``."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}  # type: ignore[arg-type]
    values.update(overrides)
    return cls(**values)
