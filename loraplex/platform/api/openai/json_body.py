"""Reading an OpenAI request body: strict UTF-8 and JSON, then the pydantic model.

FastAPI's own body parsing accepts ``NaN``, lone surrogates (``"\\ud800"``, which later
break the tokenizer) and reports decode errors as ``32: JSON decode error``. The OpenAI
routes read their body through ``read_json`` instead, so every failure is a 400 that names
what is wrong (the size limit is the middleware's, before this).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from loraplex.platform.api.errors import bad_request, validation_error

ModelT = TypeVar("ModelT", bound=BaseModel)


def _refuse_constant(name: str) -> Any:
    raise bad_request(f"Invalid JSON: {name} is not a valid JSON value.")


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _surrogate_path(root: Any) -> str | None:
    """The dotted path of the first string (value or key) holding a lone UTF-16 surrogate.

    Iterative, so a deeply nested body cannot exhaust the interpreter's stack here.
    """
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                child = f"{path}.{key}" if path else str(key)
                if not _is_text(key):
                    return path or "body"
                stack.append((child, item))
        elif isinstance(value, list):
            stack.extend(
                (f"{path}.{i}" if path else str(i), item) for i, item in reversed(list(enumerate(value)))
            )
    return None


def parse_json(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object strictly: UTF-8, no NaN/Infinity, no lone surrogates."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(
            f"Request body is not valid UTF-8 (invalid byte at position {exc.start})."
        ) from None
    if not text.strip():
        raise bad_request("Request body is empty; send a JSON object.")
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise bad_request(
            f"Invalid JSON in request body: {exc.msg} (line {exc.lineno}, column {exc.colno})."
        ) from None
    except RecursionError:
        raise bad_request("Invalid JSON in request body: nested too deeply.") from None
    if not isinstance(value, dict):
        raise bad_request("Request body must be a JSON object.")
    where = _surrogate_path(value)
    if where is not None:
        param = where if where != "body" else None
        raise bad_request(
            f"Invalid value for '{where}': the string holds a lone UTF-16 surrogate, which is not valid "
            "Unicode text.",
            param,
        )
    return value


async def read_json(request: Request, model: type[ModelT]) -> ModelT:
    """The request's body as ``model``; every failure is an ``APIError`` (400 or 413)."""
    value = parse_json(await request.body())
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


def documented_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` that documents ``model`` as the route's JSON body (``read_json`` reads it,
    so FastAPI would otherwise list none): clients, and the schema-driven tests, see the fields."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    inlined = _inline_refs(schema, defs)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inlined}}}}


def _inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    """``node`` with every ``{"$ref": "#/$defs/X"}`` replaced by ``X`` (the models have no cycles)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node
