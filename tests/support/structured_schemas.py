"""JSON schemas the structured-output tests run (issue 40): one feature each, as callers write them,
and the hostile classes (deep, huge, recursive, backtracking) a tenant may send."""

from __future__ import annotations

from typing import Any

from loraplex.platform.engine.structured.bounds import COMPILE_TIMEOUT_S, MAX_SCHEMA_DEPTH

NAME = {"type": "string", "minLength": 1, "maxLength": 16}


def _obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
    }
    schema.setdefault("additionalProperties", False)
    schema.update(extra)
    return schema


SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "enum": _obj({"color": {"enum": ["red", "green", "blue"]}}),
    "const": _obj({"kind": {"const": "person"}, "name": NAME}),
    "boolean": _obj({"done": {"type": "boolean"}, "title": NAME}),
    "int bounds": _obj({"year": {"type": "integer", "minimum": 1900, "maximum": 2100}}),
    "exclusive bounds": _obj({"score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    "number": _obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}}, additionalProperties=False),
    "nested": _obj(
        {
            "user": _obj(
                {
                    "name": NAME,
                    "address": _obj({"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
                }
            )
        }
    ),
    "array min max": _obj(
        {"tags": {"type": "array", "items": {"enum": ["a", "b", "c", "d"]}, "minItems": 1, "maxItems": 3}}
    ),
    "array of objects": _obj(
        {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": _obj(
                    {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    }
                ),
            }
        }
    ),
    "anyOf": _obj(
        {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"enum": ["none", "many"]}]}}
    ),
    "nullable": _obj(
        {
            "nickname": {"anyOf": [NAME, {"type": "null"}]},
            "age": {"type": ["integer", "null"], "minimum": 0, "maximum": 99},
        }
    ),
    "string pattern": _obj({"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}}),
    "email-like": _obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}}),
    "optional fields": _obj({"name": NAME, "note": {"type": "string", "maxLength": 10}}, required=["name"]),
    "oneOf": _obj(
        {
            "shape": {
                "oneOf": [
                    _obj({"circle": {"type": "integer", "minimum": 1, "maximum": 9}}),
                    _obj({"square": {"type": "integer", "minimum": 1, "maximum": 9}}),
                ]
            }
        }
    ),
    "date format": _obj({"day": {"type": "string", "format": "date"}}),
    "ref defs": {
        "$defs": {
            "pt": _obj(
                {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                }
            )
        },
        **_obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}),
    },
    "tuple prefixItems": _obj(
        {
            "pair": {
                "type": "array",
                "prefixItems": [NAME, {"type": "integer", "minimum": 0, "maximum": 9}],
                "items": False,
                "minItems": 2,
            }
        }
    ),
    "top-level array": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 2, "maxItems": 4},
    "top-level enum": {"enum": ["yes", "no", "maybe"]},
    "deepish": _obj(
        {"a": _obj({"b": _obj({"c": _obj({"d": {"type": "integer", "minimum": 0, "maximum": 5}})})})}
    ),
}


def _deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HOSTILE: dict[str, dict[str, Any]] = {
    "deep nesting": _deep(MAX_SCHEMA_DEPTH * 4),
    "huge enum": {"enum": [f"value-{i}" for i in range(200_000)]},
    "recursive $ref": {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"},
    "backtracking pattern": {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^(a+)+$", "maxLength": 12}},
        "required": ["s"],
    },
}
BOUND_S = COMPILE_TIMEOUT_S + 20
"""What docs/operations.md states: a hostile schema is answered (200 or 400) within the compile
timeout plus a generation of max_tokens."""
