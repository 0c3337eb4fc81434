"""Reading an OpenAI request body: strict UTF-8 and JSON, then the pydantic model.

FastAPI's own body parsing accepts ``NaN``, lone surrogates (``"\\ud800"``, which later
break the tokenizer) and reports decode errors as ``32: JSON decode error``. The OpenAI
routes read their body through ``read_json`` instead, so every failure is a 400 that names
what is wrong (the size limit is the middleware's, before this). The JSON itself is read by
``loraplex.strict_json`` (depth, integer digits, no NaN, numbers that overflow to infinity), the
parser ``adapter_config.json`` goes through too.

The cost of a body is bounded by its size, never by its shape: the check for lone surrogates
looks at the raw text first (a lone surrogate can only arrive as a ``\\uD8xx``-``\\uDFxx``
escape), and walks the parsed value only when one is there, within ``_MAX_WALK`` values. A
body over ``OFF_LOOP_BYTES`` is parsed and validated in a worker thread, so the event loop
stays responsive while a large, deeply structured body is decoded.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from loraplex import strict_json
from loraplex.platform.api.errors import APIError, bad_request, validation_error

ModelT = TypeVar("ModelT", bound=BaseModel)

OFF_LOOP_BYTES = 64 * 1024
"""Bodies larger than this are parsed and validated in a worker thread."""
_MAX_WALK = 100_000
"""Values walked to name the field that holds a lone surrogate (past it: the body is named)."""
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


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
    walked = 0
    while stack:
        walked += 1
        if walked > _MAX_WALK:
            return "body"
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
                (f"{path}.{i}" if path else str(i), item)
                for i, item in reversed(list(enumerate(value[:_MAX_WALK])))
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
        value = strict_json.loads(text)
    except strict_json.JSONLimitError as exc:
        raise bad_request(f"Invalid JSON in request body: {exc}") from None
    if not isinstance(value, dict):
        raise bad_request("Request body must be a JSON object.")
    if _SURROGATE_ESCAPE.search(text) is None:
        return value  # valid UTF-8 holds no surrogate; only an escape can make one
    where = _surrogate_path(value)
    if where is not None:
        param = where if where != "body" else None
        raise bad_request(
            f"Invalid value for '{where}': the string holds a lone UTF-16 surrogate, which is not valid "
            "Unicode text.",
            param,
        )
    return value


async def read_json(
    request: Request, model: type[ModelT], max_items: Mapping[str, int] | None = None
) -> ModelT:
    """The request's body as ``model``; every failure is an ``APIError`` (400, 413 or 415).

    ``max_items``: the most entries a top-level list field may hold (``messages``), checked right
    after the JSON is parsed, before validating or rendering any of them."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        # A web page can post text/plain or a form cross-site without a preflight; never JSON.
        raise APIError(
            415,
            "Send the request body as JSON with 'Content-Type: application/json'.",
            code="unsupported_media_type",
        )
    raw = await request.body()
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_body, raw, model, max_items)
    return parse_body(raw, model, max_items)


def parse_body(raw: bytes, model: type[ModelT], max_items: Mapping[str, int] | None = None) -> ModelT:
    """``parse_json``, the list sizes of ``max_items``, then ``model``; every failure is an
    ``APIError`` (400)."""
    value = parse_json(raw)
    for name, most in (max_items or {}).items():
        items = value.get(name)
        if isinstance(items, list) and len(items) > most:
            raise bad_request(f"'{name}' has {len(items)} entries, over this server's limit of {most}.", name)
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None
    except ValueError as exc:  # a validator's own arithmetic on an absurd number
        raise bad_request(f"Invalid request body: {exc}") from None


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
