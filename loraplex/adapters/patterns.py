"""PEFT's ``rank_pattern`` / ``alpha_pattern`` keys, matched in time linear in the module name.

PEFT matches each key with Python's ``re`` (``re.match(rf"(.*\\.)?({key})$", module_key)``).
``re`` backtracks: a key such as ``(a|a)*b`` or ``(.*.*)*x`` takes time exponential in the
name's length, holding the GIL the whole time, so one tenant's config would stop the event
loop and the engine thread. Here the same expression (parsed by ``re``'s own parser, so the
syntax and the meaning are exactly PEFT's) is compiled to a Thompson NFA and simulated state
set by state set (a Pike VM without captures): at most ``len(module_key) * num_states``
steps, whatever the pattern. Constructs that need backtracking (backreferences, lookaround,
conditionals) and flags are refused when the config is parsed, with a clear reason; so are
patterns over ``MAX_PATTERN_CHARS`` characters or ``MAX_NFA_STATES`` states (``a{1000}``).

The state sets reached are cached per pattern (a DFA built lazily), so the hundreds of module
names of one model, which share most of their characters, cost little more than one.
"""

from __future__ import annotations

import re
import re._constants as sre_c
import re._parser as sre_parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_PATTERN_CHARS = 512
"""Longest rank_pattern / alpha_pattern key accepted."""
MAX_NFA_STATES = 4096
"""Largest compiled pattern (counted repeats are unrolled: ``x{1000}`` is 1000 states)."""
_MAX_CACHED = 20_000
"""Cached transitions per pattern; past it, state sets are computed again (still linear)."""


class UnsupportedPattern(ValueError):
    """A pattern this matcher does not run (it would need backtracking, or is too large)."""


CharTest = Callable[[str], bool]


@dataclass
class _Node:
    kind: str  # "char" | "split" | "assert" | "match"
    test: CharTest | None = None
    at: Any = None  # the AT code of an "assert" node
    outs: list[int] = field(default_factory=list)


def _is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


_CATEGORIES: dict[Any, CharTest] = {
    sre_c.CATEGORY_DIGIT: str.isdecimal,
    sre_c.CATEGORY_NOT_DIGIT: lambda ch: not ch.isdecimal(),
    sre_c.CATEGORY_SPACE: str.isspace,
    sre_c.CATEGORY_NOT_SPACE: lambda ch: not ch.isspace(),
    sre_c.CATEGORY_WORD: _is_word,
    sre_c.CATEGORY_NOT_WORD: lambda ch: not _is_word(ch),
}


def _equals(c: str) -> CharTest:
    return lambda ch: ch == c


def _differs(c: str) -> CharTest:
    return lambda ch: ch != c


def _in_range(lo: int, hi: int) -> CharTest:
    return lambda ch: lo <= ord(ch) <= hi


def _class_test(items: list[tuple[Any, Any]]) -> CharTest:
    negate = False
    tests: list[CharTest] = []
    for op, av in items:
        if op is sre_c.NEGATE:
            negate = True
        elif op is sre_c.LITERAL:
            tests.append(_equals(chr(av)))
        elif op is sre_c.RANGE:
            tests.append(_in_range(av[0], av[1]))
        elif op is sre_c.CATEGORY and av in _CATEGORIES:
            tests.append(_CATEGORIES[av])
        else:
            raise UnsupportedPattern(f"the character class item {op} is not supported")
    if negate:
        return lambda ch: not any(t(ch) for t in tests)
    return lambda ch: any(t(ch) for t in tests)


_ASSERTS = (
    sre_c.AT_BEGINNING,
    sre_c.AT_BEGINNING_STRING,
    sre_c.AT_END,
    sre_c.AT_END_STRING,
    sre_c.AT_BOUNDARY,
    sre_c.AT_NON_BOUNDARY,
)


class _Builder:
    """Thompson construction, continuation style: ``seq(items, next)`` is the state that
    matches ``items`` and then continues at state ``next``."""

    def __init__(self) -> None:
        self.nodes: list[_Node] = []

    def add(self, node: _Node) -> int:
        if len(self.nodes) >= MAX_NFA_STATES:
            raise UnsupportedPattern(f"the pattern compiles to over {MAX_NFA_STATES} states")
        self.nodes.append(node)
        return len(self.nodes) - 1

    def seq(self, items: Any, nxt: int) -> int:
        for op, av in reversed(list(items)):
            nxt = self.item(op, av, nxt)
        return nxt

    def item(self, op: Any, av: Any, nxt: int) -> int:
        if op is sre_c.LITERAL:
            return self.add(_Node("char", _equals(chr(av)), outs=[nxt]))
        if op is sre_c.NOT_LITERAL:
            return self.add(_Node("char", _differs(chr(av)), outs=[nxt]))
        if op is sre_c.ANY:
            return self.add(_Node("char", lambda ch: ch != "\n", outs=[nxt]))
        if op is sre_c.IN:
            return self.add(_Node("char", _class_test(av), outs=[nxt]))
        if op is sre_c.AT:
            if av not in _ASSERTS:
                raise UnsupportedPattern(f"the anchor {av} is not supported")
            return self.add(_Node("assert", at=av, outs=[nxt]))
        if op is sre_c.BRANCH:
            return self.add(_Node("split", outs=[self.seq(alt, nxt) for alt in av[1]]))
        if op is sre_c.SUBPATTERN:
            _group, add_flags, del_flags, sub = av
            if add_flags or del_flags:
                raise UnsupportedPattern("inline flags such as (?i:...) are not supported")
            return self.seq(sub, nxt)
        if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT):  # greedy or lazy: the same for a yes/no match
            return self.repeat(av, nxt)
        raise UnsupportedPattern(
            f"{str(op).lower()} is not supported (backreferences, lookaround, atomic groups and "
            "possessive repeats need a backtracking matcher)"
        )

    def repeat(self, av: Any, nxt: int) -> int:
        low, high, sub = av
        if high is sre_c.MAXREPEAT or high == sre_c.MAXREPEAT:
            loop = self.add(_Node("split"))
            self.nodes[loop].outs = [self.seq(sub, loop), nxt]
            tail = loop
        else:
            tail = nxt
            for _ in range(int(high) - int(low)):  # each optional copy may stop the rest
                tail = self.add(_Node("split", outs=[self.seq(sub, tail), nxt]))
        for _ in range(int(low)):
            tail = self.seq(sub, tail)
        return tail


class LinearPattern:
    """One PEFT pattern key, matched against module names without backtracking."""

    def __init__(self, key: str) -> None:
        if len(key) > MAX_PATTERN_CHARS:
            raise UnsupportedPattern(f"it is longer than {MAX_PATTERN_CHARS} characters")
        try:
            re.compile(key)
            parsed = sre_parse.parse(rf"(.*\.)?({key})$")
        except (re.error, RecursionError, OverflowError) as exc:
            raise UnsupportedPattern(f"not a valid regex ({exc})") from None
        if parsed.state.flags & ~sre_c.SRE_FLAG_UNICODE:
            raise UnsupportedPattern("inline flags such as (?i) are not supported")
        self.key = key
        own = sre_parse.parse(key)
        self.literal: str | None = None
        """The text the key stands for when it has no operator (the usual case: a module name)."""
        if all(op is sre_c.LITERAL for op, _ in own):
            self.literal = "".join(chr(av) for _, av in own)
        builder = _Builder()
        final = builder.add(_Node("match"))
        try:
            self.start = builder.seq(parsed, final)
        except RecursionError:
            raise UnsupportedPattern("it is nested too deeply") from None
        self.nodes = builder.nodes
        self.final = final
        self.num_states = 0 if self.literal is not None else len(self.nodes)
        """States a match walks (0 for a literal key, which is compared as text)."""
        self._closures: dict[tuple[frozenset[int], tuple[bool, ...]], frozenset[int]] = {}
        self._steps: dict[tuple[frozenset[int], str], frozenset[int]] = {}

    def _holds(self, at: Any, ctx: tuple[bool, ...]) -> bool:
        at_start, at_end, before_newline_end, prev_word, next_word = ctx
        if at in (sre_c.AT_BEGINNING, sre_c.AT_BEGINNING_STRING):
            return at_start
        if at is sre_c.AT_END:
            return at_end or before_newline_end
        if at is sre_c.AT_END_STRING:
            return at_end
        if at is sre_c.AT_BOUNDARY:
            return prev_word != next_word
        return prev_word == next_word  # AT_NON_BOUNDARY

    def _closure(self, states: frozenset[int], ctx: tuple[bool, ...]) -> frozenset[int]:
        cached = self._closures.get((states, ctx))
        if cached is not None:
            return cached
        seen: set[int] = set()
        stack = list(states)
        while stack:
            s = stack.pop()
            if s in seen:
                continue
            seen.add(s)
            node = self.nodes[s]
            if node.kind == "split" or (node.kind == "assert" and self._holds(node.at, ctx)):
                stack.extend(node.outs)
        out = frozenset(s for s in seen if self.nodes[s].kind in ("char", "match"))
        if len(self._closures) < _MAX_CACHED:
            self._closures[(states, ctx)] = out
        return out

    def _step(self, states: frozenset[int], ch: str) -> frozenset[int]:
        cached = self._steps.get((states, ch))
        if cached is not None:
            return cached
        out = set()
        for s in states:
            node = self.nodes[s]
            if node.kind == "char" and node.test is not None and node.test(ch):
                out.update(node.outs)
        result = frozenset(out)
        if len(self._steps) < _MAX_CACHED:
            self._steps[(states, ch)] = result
        return result

    def matches(self, module_key: str) -> bool:
        """``re.match(rf"(.*\\.)?({key})$", module_key) is not None``, in linear time."""
        if self.literal is not None:
            return self._matches_literal(module_key)
        n = len(module_key)
        states = frozenset([self.start])
        for i in range(n + 1):
            ctx = (
                i == 0,
                i == n,
                i == n - 1 and module_key[-1] == "\n",
                i > 0 and _is_word(module_key[i - 1]),
                i < n and _is_word(module_key[i]),
            )
            states = self._closure(states, ctx)
            if self.final in states:
                return True
            if i == n or not states:
                return False
            states = self._step(states, module_key[i])
        return False

    def _matches_literal(self, module_key: str) -> bool:
        # (.*\.)?(literal)$ : an optional prefix ending in "." (no newline before it, as "."
        # never matches one), the literal, then the end or a final newline.
        assert self.literal is not None
        for body in (module_key, module_key[:-1] if module_key.endswith("\n") else None):
            if body is None or not body.endswith(self.literal):
                continue
            prefix = body[: len(body) - len(self.literal)]
            if prefix == "" or (prefix.endswith(".") and "\n" not in prefix):
                return True
        return False
