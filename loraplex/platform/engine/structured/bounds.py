"""What a tenant's constraint is held to: checked before compiling, and given to llguidance.

A schema is a tenant's input, so its cost must be bounded before any work is spent on it.
The shape checks here are cheap (one iterative walk, bounded by the body size); the rest is
llguidance's own fuel and size limits (``LLParserLimits``), which bound a compile and every
mask; the wall-clock bound is the server's (``AsyncEngine.compile_grammar``).
"""

from __future__ import annotations

from typing import Any

import llguidance

MAX_SCHEMA_BYTES = 1 << 20
"""Largest constraint (schema, regex, grammar or choices) in bytes of JSON / text: 1 MiB."""
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of a JSON schema's objects and arrays."""
MAX_SCHEMA_NODES = 100_000
"""Most values (objects, arrays, strings, numbers) in one schema."""
MAX_CHOICES = 10_000
"""Most entries of ``choice``."""
COMPILE_WORKERS = 2
"""Threads compiling the server's constraints (each compile drops the GIL)."""
COMPILE_TIMEOUT_S = 10.0
"""Longest the server waits for a compile before it answers 400 (llguidance's fuel ends it sooner)."""


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's limits, tighter than its defaults where a tenant's schema could spend them:
    the grammar's size (memory), the lexer states (1-2 kB each: at most ~100 MB) and the fuel of
    the first lexer build and of each mask step (time)."""
    return llguidance.LLParserLimits(
        max_grammar_size=200_000,
        max_lexer_states=50_000,
        initial_lexer_fuel=1_000_000,
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        verbose_errors=False,  # errors go back to the client: no grammar internals in them
    )


def schema_shape_problem(schema: Any) -> str | None:
    """Why ``schema`` (parsed JSON) is over the shape bounds, or None. Iterative: a schema nested
    far deeper than the limit costs no stack."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    nodes = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            return f"the schema has more than {MAX_SCHEMA_NODES} values"
        if isinstance(value, dict | list):
            if depth > MAX_SCHEMA_DEPTH:
                return f"the schema is nested deeper than {MAX_SCHEMA_DEPTH} levels"
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)
    return None
