"""Every server setting described once: its section, name, type, default and docstring.

The CLI makes its flags from these, the loader its environment names, ``--print-settings``
its table: adding a field to a section adds the flag, the ``LORAPLEX_<NAME>`` variable and
the TOML key, with the field's docstring as help.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic_core import PydanticUndefined

from loraplex.platform.settings.units import is_byte_setting

ENV_PREFIX = "LORAPLEX_"


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the class ``cls`` (the string literal that follows it)."""
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


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(T, True) for ``T | None``; (tp, False) otherwise."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return tp, False


@dataclass(frozen=True)
class SettingField:
    """One setting: where it lives, its type, default and help."""

    section: str
    name: str
    annotation: Any
    default: Any
    """The default value; ``None`` also for fields whose default is computed (see ``default_text``)."""
    default_text: str
    doc: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def base_type(self) -> Any:
        return unwrap_optional(self.annotation)[0]

    @property
    def is_bool(self) -> bool:
        return self.base_type is bool

    @property
    def is_list(self) -> bool:
        return typing.get_origin(self.base_type) is list

    @property
    def is_bytes(self) -> bool:
        return is_byte_setting(self.name) and self.base_type is int

    @property
    def is_secret(self) -> bool:
        return self.base_type is SecretStr

    @property
    def choices(self) -> tuple[str, ...] | None:
        tp = self.base_type
        if typing.get_origin(tp) is typing.Literal:
            return tuple(str(a) for a in typing.get_args(tp))
        return None


def section_fields(section: str, cls: Any) -> list[SettingField]:
    """The settings of one section class: a pydantic model or a dataclass."""
    out: list[SettingField] = []
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        hints = typing.get_type_hints(cls)
        for name, info in cls.model_fields.items():
            if info.default is not PydanticUndefined:
                default, text = info.default, repr(info.default)
            else:
                default, text = None, "(computed)"
            doc = " ".join((info.description or "").split())
            out.append(SettingField(section, name, hints[name], default, text, doc))
        return out
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default, text = f.default, repr(f.default)
        else:
            default, text = None, "(computed)"
        out.append(SettingField(section, f.name, hints[f.name], default, text, docs.get(f.name, "")))
    return out
