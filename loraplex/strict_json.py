"""Strict, bounded JSON: what a client or a tenant's file may hand the server.

Python's ``json.loads`` has three costs a hostile input can blow up: nesting (its C scanner
recurses, and ``RecursionError`` escapes as a crash), integers (converting a long digit string
is quadratic; past ``sys.int_info.default_max_str_digits`` it raises ``ValueError``) and the
constants ``NaN`` / ``Infinity``, which are not JSON. ``loads`` turns every one of them into a
``JSONLimitError`` (a ``ValueError``) with a sentence for the client, before any object is built:
nesting is measured on the raw text first (a few C-speed passes; ``DEPTH_SCAN_BYTES``), integers
are limited to ``MAX_INT_DIGITS`` digits while parsing. Request bodies (``platform.api``) and
``adapter_config.json`` (``adapters``) both read through it, so both answer 400, never 500.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects (an OpenAI body nests 5 deep, a PEFT config 3)."""
MAX_INT_DIGITS = 64
"""Longest integer literal, in digits (int64 takes 19; a seed of 2**64 takes 20)."""
DEPTH_SCAN_BYTES = 1 << 20
"""Texts up to this size have their nesting measured before parsing (about 30 ms a MiB); a larger
one (a request body of many messages) is bounded by the interpreter's recursion limit instead,
which the parser's C scanner honours (``RecursionError``, refused here as too deep)."""

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class JSONLimitError(ValueError):
    """The text is not JSON, or over a limit; ``str()`` is one sentence that says which."""


def _too_deep(raw: bytes) -> bool:
    """True when ``raw`` nests deeper than ``MAX_DEPTH`` (or its brackets do not pair up).

    In C-speed passes, never recursing: strings dropped, everything but brackets dropped, then
    the innermost pairs removed ``MAX_DEPTH`` times; brackets left over are deeper than that."""
    # Escaped backslashes, then escaped quotes, go first: every quote left opens or closes a string,
    # so the pieces between them alternate outside / inside.
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(unescaped.split(b'"')[::2])
    brackets = outside.translate(None, _NOT_BRACKETS)
    for _ in range(MAX_DEPTH):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"").replace(b"{}", b"")
    return bool(brackets)


def _int(text: str) -> int:
    digits = len(text) - (text[0] == "-")
    if digits > MAX_INT_DIGITS:
        raise JSONLimitError(f"an integer has too many digits ({digits}; the limit is {MAX_INT_DIGITS}).")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONLimitError(f"the number {text[:32]} is too large.")
    return value


def _refuse_constant(name: str) -> Any:
    raise JSONLimitError(f"{name} is not a valid JSON value.")


def loads(raw: bytes | str) -> Any:
    """Parse ``raw`` (UTF-8 bytes or text) strictly within the limits above; ``JSONLimitError``
    (with a sentence naming the problem, and where for a syntax error) otherwise."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    small = len(data) <= DEPTH_SCAN_BYTES
    if small and data.count(b"[") + data.count(b"{") > MAX_DEPTH and _too_deep(data):
        raise JSONLimitError(f"nested more than {MAX_DEPTH} levels deep (or its brackets do not pair up).")
    try:
        text = raw if isinstance(raw, str) else raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JSONLimitError(f"not valid UTF-8 (byte {exc.start}).") from None
    try:
        return json.loads(text, parse_int=_int, parse_float=_finite_float, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise JSONLimitError(f"{exc.msg} (line {exc.lineno}, column {exc.colno}).") from None
    except RecursionError:  # a large text nested past the interpreter's recursion limit
        raise JSONLimitError("nested too deeply.") from None
