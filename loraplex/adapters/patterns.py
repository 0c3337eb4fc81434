"""PEFT's ``rank_pattern`` / ``alpha_pattern`` keys, matched by RE2 in time linear in the module name.

PEFT matches each key with Python's ``re`` (``re.match(rf"(.*\\.)?({key})$", module_key)``).
``re`` backtracks: a key such as ``(a|a)*b`` or ``(a+)+$`` takes time exponential in the
name's length, holding the GIL the whole time, so one tenant's config would stop the event
loop and the engine thread. Here the same rule runs on RE2 (``google-re2``): an automaton,
no backtracking, time linear in the name whatever the key, and it runs in C.

RE2 and ``re`` read some of the same text differently, and what we serve must be what PEFT
loads; so a key is used only when both accept it and nothing in it is read differently:

- ``re.compile`` must accept it (PEFT would fail on it otherwise: ``\\z``, ``\\pL``, ``\\Q..\\E``,
  ``\\x{41}``, ``(?<name>..)`` are RE2's alone), and RE2 must compile it: backreferences,
  lookaround, atomic groups, possessive repeats, conditionals, ``(?#..)``, ``[\\b]``,
  ``\\u`` / ``\\U`` / ``\\N{..}`` escapes and counted repeats over 1000 are ``re``'s alone.
- Refused although both accept them (``_refuse_differing_syntax``):
  ``\\1`` .. ``\\9`` (``re``: a backreference, or an octal escape when three digits;
  RE2: ``\\12`` is octal), with ``\\Z`` (RE2 has no ``\\Z``; ``$`` means the same here);
  ``{,n}`` / ``{,}``, counts with leading zeros (``{01}``) and counts over 1000 (``re``: a
  repeat; RE2: literal text); ``[`` inside a character class (``[[:alpha:]]`` is a POSIX
  class to RE2, a set followed by ``]`` to ``re``) and doubled ``--`` / ``&&`` / ``~~`` /
  ``||`` in a class (``re`` warns they will become set operations); inline flags such as
  ``(?i)`` (the flags and the case-folding tables differ) and every group form but ``(?:``
  and ``(?P<name>``; and any non-ASCII character: module names are ASCII, so such a
  character could only ever match in a negated class, and without them RE2 runs on bytes
  (Latin-1), where ``.`` is one instruction instead of UTF-8's several.

The difference that remains is in the names, not the keys: RE2's ``\\d``, ``\\w``, ``\\s``
and ``\\b`` are ASCII where ``re``'s are Unicode (``\\s`` also takes ``\\v`` and
``\\x1c``-``\\x1f`` in ``re``), ``re``'s ``$`` also holds before a final newline and its
``\\B`` never matches an empty name. None of that can show on a non-empty name of printable
ASCII, which is every name PEFT saves a LoRA weight under (``peft_weights._LORA_KEY``), so
``LinearPattern.matches`` takes only those and raises ``ValueError`` on any other.

Keys over ``MAX_PATTERN_CHARS`` characters or compiling to over ``MAX_NFA_STATES`` RE2
instructions (``a{1000}`` is about 1000) are refused too: the sum over a config's keys bounds
what matching every module name of a model costs (``peft_config.MAX_PATTERN_STATES``).
"""

from __future__ import annotations

import re
from typing import Any

import re2

MAX_PATTERN_CHARS = 512
"""Longest rank_pattern / alpha_pattern key accepted."""
MAX_NFA_STATES = 4096
"""Largest compiled pattern, in RE2 program instructions (counted repeats are unrolled)."""
MAX_REPEAT = 1000
"""Largest count in ``x{n}`` / ``x{n,m}``: RE2's own limit (it reads larger counts as text)."""
_RE2_MAX_MEM = 256 << 10
"""RE2's memory budget per pattern (program and DFA cache): ample for MAX_NFA_STATES
instructions, small enough that compiling a huge pattern fails at once. A DFA that runs
out falls back to RE2's NFA, which is still linear."""

_REPEAT = re.compile(r"\{([0-9]*)(?:(,)([0-9]*))?\}")
"""What ``re`` reads as a counted repeat at a ``{`` (``{}`` alone is literal)."""
_FLAGS = frozenset("aiLmsux-")


class UnsupportedPattern(ValueError):
    """A pattern this matcher does not run (RE2 cannot, RE2 would read it differently from
    Python's ``re``, or it is too large)."""


def _re2_options() -> Any:
    options = re2.Options()
    options.never_capture = True  # only a yes / no answer: RE2 can use its DFA
    options.log_errors = False  # a tenant's bad pattern is a 400, not a log line
    options.max_mem = _RE2_MAX_MEM
    options.encoding = re2.Options.Encoding.LATIN1  # keys and names are ASCII: one byte a character
    return options


_OPTIONS = _re2_options()


def _check_escape(char: str) -> None:
    if "1" <= char <= "9":
        raise UnsupportedPattern(
            f"\\{char}: backreferences are not supported (RE2 has none; to RE2 \\12 is an octal "
            "escape); write a character as \\xNN"
        )
    if char == "Z":
        raise UnsupportedPattern("\\Z is not supported (RE2 does not know it); write $")


def _check_group(key: str, i: int) -> None:
    """``key[i:i + 2]`` is ``(?``: only ``(?:`` and ``(?P<name>`` read the same in both."""
    rest = key[i + 2 : i + 4]
    if rest.startswith(":") or rest == "P<":
        return
    backtracking = "(it needs a backtracking matcher; RE2 has none)"
    if rest == "P=":
        reason = f"backreferences such as (?P=name) are not supported {backtracking}"
    elif rest[:1] in ("=", "!") or rest in ("<=", "<!"):
        reason = f"lookaround such as (?=...) or (?<!...) is not supported {backtracking}"
    elif rest.startswith(">"):
        reason = f"atomic groups (?>...) are not supported {backtracking}"
    elif rest.startswith("("):
        reason = f"conditionals (?(1)...) are not supported {backtracking}"
    elif rest.startswith("#"):
        reason = "comments (?#...) are not supported (RE2 does not know them)"
    elif rest[:1] in _FLAGS:
        reason = (
            "inline flags such as (?i) or (?i:...) are not supported "
            "(RE2's flags and case folding differ from Python's re)"
        )
    else:
        reason = f"the group (?{rest[:1]} is not supported (only (?:...) and (?P<name>...))"
    raise UnsupportedPattern(reason)


def _skip_class(key: str, i: int) -> int:
    """Check the character class opened just before ``key[i]``; return the index past it."""
    n = len(key)
    if key.startswith("^", i):
        i += 1
    if key.startswith("]", i):  # a "]" first is a literal, to both
        i += 1
    while i < n:
        c = key[i]
        if c == "\\":
            _check_escape(key[i + 1 : i + 2])
            i += 2
        elif c == "]":
            return i + 1
        elif c == "[":
            raise UnsupportedPattern(
                "'[' inside a character class is not supported ([[:alpha:]] is a POSIX class to "
                "RE2 but not to Python's re); write \\["
            )
        elif c in "-&~|" and key.startswith(c, i + 1):
            raise UnsupportedPattern(
                f"{c}{c} inside a character class is not supported (Python's re reserves it for "
                f"set operations); write \\{c}\\{c}"
            )
        else:
            i += 1
    return n  # unterminated: re.compile says so


def _check_repeat(key: str, i: int) -> None:
    """``key[i]`` is ``{`` outside a class."""
    found = _REPEAT.match(key, i)
    if found is None or not (found[1] or found[2]):
        return  # literal text to both
    text, low, high = found[0], found[1], found[3]
    if not low:
        raise UnsupportedPattern(f"{text} is not supported (RE2 reads it as text); write {{0{text[1:]}")
    for count in (low, high):
        if count and len(count) > 1 and count.startswith("0"):
            raise UnsupportedPattern(
                f"{text}: counts with leading zeros are not supported (RE2 reads it as text)"
            )
        if count and int(count) > MAX_REPEAT:
            raise UnsupportedPattern(
                f"{text}: counts over {MAX_REPEAT} are not supported (RE2's limit; the pattern would "
                "compile to too many states)"
            )


def _refuse_differing_syntax(key: str) -> None:
    """Refuse what both ``re`` and RE2 may accept but read differently (the module docstring)."""
    i, n = 0, len(key)
    while i < n:
        c = key[i]
        if c == "\\":
            _check_escape(key[i + 1 : i + 2])
            i += 2
            continue
        if c == "[":
            i = _skip_class(key, i + 1)
            continue
        if c == "(" and key.startswith("?", i + 1):
            _check_group(key, i)
        elif c == "{":
            _check_repeat(key, i)
        i += 1


def _is_module_name(module_key: str) -> bool:
    return bool(module_key) and module_key.isascii() and module_key.isprintable()


class LinearPattern:
    """One PEFT pattern key, matched against module names by RE2 (no backtracking)."""

    def __init__(self, key: str) -> None:
        if len(key) > MAX_PATTERN_CHARS:
            raise UnsupportedPattern(f"it is longer than {MAX_PATTERN_CHARS} characters")
        if not key.isascii():
            bad = next(c for c in key if not c.isascii())
            raise UnsupportedPattern(
                f"it holds the non-ASCII character {bad!r}; module names are ASCII, write the key in ASCII"
            )
        _refuse_differing_syntax(key)
        try:
            re.compile(key)
            re.compile(rf"(.*\.)?({key})$")
        except (re.error, RecursionError, OverflowError) as exc:
            raise UnsupportedPattern(f"not a valid regex ({exc})") from None
        try:
            self._regexp = re2.compile(rf"(?:.*\.)?(?:{key})".encode("ascii"), _OPTIONS)
        except re2.error as exc:
            reason = (
                exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
            )
            if "pattern too large" in str(reason):
                raise UnsupportedPattern(f"the pattern compiles to over {MAX_NFA_STATES} states") from None
            raise UnsupportedPattern(
                f"RE2 cannot run it ({reason}): backreferences, lookaround, atomic groups, "
                "possessive repeats and \\u escapes are not supported"
            ) from None
        size = int(self._regexp.programsize)
        if size > MAX_NFA_STATES:
            raise UnsupportedPattern(f"the pattern compiles to over {MAX_NFA_STATES} states ({size})")
        self.key = key
        self.literal: str | None = key if re.escape(key) == key else None
        """The text the key stands for when it has no operator (the usual case: a module name)."""
        self.num_states = 0 if self.literal is not None else size
        """RE2 instructions a match walks (0 for a literal key, which is compared as text)."""

    def matches(self, module_key: str) -> bool:
        """``re.match(rf"(.*\\.)?({key})$", module_key) is not None``, in linear time.

        ``module_key`` must be a non-empty name of printable ASCII (every name PEFT saves a
        LoRA weight under); ``ValueError`` otherwise, as there RE2's answer may differ."""
        if not _is_module_name(module_key):
            raise ValueError(f"module name {module_key[:80]!r} is not a non-empty name of printable ASCII")
        if self.literal is not None:
            return module_key == self.literal or module_key.endswith("." + self.literal)
        return self._regexp.fullmatch(module_key.encode("ascii")) is not None
