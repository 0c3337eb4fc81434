"""``LinearPattern``: PEFT's pattern rule, matched by RE2 (no backtracking), exactly as ``re`` would."""

from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.adapters import AdapterValidationError
from loraplex.adapters.patterns import LinearPattern, UnsupportedPattern
from loraplex.adapters.peft_config import parse_lora_config

MODULE_KEYS = [
    "model.layers.3.self_attn.q_proj",
    "model.layers.13.mlp.down_proj",
    "q_proj",
    "a.b c.q_proj",
    "x{,2}.[a]",
    "_",
]
ATOMS = [
    "q_proj",
    r"\.",
    ".",
    r"\d",
    r"\w",
    r"\s",
    "[a-z_]",
    "[^.]",
    "[]a]",
    "(a|q)",
    "mlp",
    "layers",
    "_",
    r"\b",
    r"\B",
    "^",
    "$",
    "x",
    " ",
    "{,2}",
    "[[:alpha:]]",
    r"\Z",
]


@st.composite
def patterns(draw: st.DrawFn) -> str:
    parts = draw(st.lists(st.sampled_from(ATOMS), min_size=1, max_size=6))
    out = ""
    for part in parts:
        out += part + draw(st.sampled_from(["", "", "*", "+", "?", "{1,3}", "*?"]))
        if part in ("^", "$", r"\b"):
            out = (
                out.rstrip("*+?{1,3}") if out.endswith(("*", "+", "?", "}")) and out[-2:-1] in "^$b" else out
            )
    if draw(st.booleans()):
        out = f"({out})|{draw(st.sampled_from(ATOMS))}"
    return out


def _peft(pattern: str, key: str) -> bool:
    return re.match(rf"(.*\.)?({pattern})$", key) is not None


@settings(max_examples=400, deadline=None, derandomize=True)
@given(pattern=patterns())
def test_same_answers_as_re(pattern: str) -> None:
    try:  # first: it refuses [[:alpha:]] before re would warn about a nested set
        matcher = LinearPattern(pattern)
    except UnsupportedPattern:
        return
    for key in MODULE_KEYS:
        assert matcher.matches(key) == _peft(pattern, key), (pattern, key)


@pytest.mark.parametrize("pattern", ["(a|a)*b", "(.*.*)*x", "(?:.|.){0,30}!", "(\\w+\\.?)+!", "(a*)*$"])
def test_catastrophic_patterns_run_in_linear_time(pattern: str) -> None:
    matcher = LinearPattern(pattern)
    started = time.monotonic()
    for key in ("a" * 2000, "model.layers.10.self_attn.q_proj" * 20):
        matcher.matches(key)
    assert time.monotonic() - started < 0.5


@pytest.mark.parametrize(
    "pattern,reason",
    [
        (r"(q)\1", "backreferences"),
        ("(?=q)", "lookaround"),
        ("(?i:q)", "inline flags"),
        ("q{5000}", "states"),
        ("q" * 600, "longer than"),
    ],
)
def test_unsupported_patterns_are_refused_at_parse(pattern: str, reason: str) -> None:
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "rank_pattern": {pattern: 2}}
    with pytest.raises(AdapterValidationError, match=reason) as info:
        parse_lora_config(json.dumps(config).encode(), "cfg")
    assert info.value.reason == "bad_config"


def test_nested_quantifier_on_a_long_name_is_linear() -> None:
    # Python's re takes ~2^n steps on (a+)+$ against "a" * n + "!" (0.1 s at n=22, doubling with
    # each "a"); RE2's work is bounded by len(name) * num_states, whatever the pattern.
    matcher = LinearPattern("(a+)+$")
    assert 0 < matcher.num_states < 64
    name = "a" * 50_000 + "!"
    started = time.monotonic()
    assert not matcher.matches(name)
    assert matcher.matches("model." + "a" * 50_000)
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    "pattern,reason",
    [
        (r"(q)\1", "backreferences"),
        (r"(?P<x>q)(?P=x)", "backreferences"),
        ("(?=q)q_proj", "lookaround"),
        ("(?!k)q_proj", "lookaround"),
        ("(?<=self_attn\\.)q_proj", "lookaround"),
        ("(?<!mlp\\.)q_proj", "lookaround"),
        ("(?>q)_proj", "atomic groups"),
        ("q*+_proj", "possessive"),
        ("(?i)Q_PROJ", "inline flags"),
        ("(?#note)q_proj", "comments"),
        ("q{,2}_proj", "RE2 reads it as text"),
        ("q{01}_proj", "leading zeros"),
        ("q{1001}", "over 1000"),
        ("(?:abcdefgh){1000}", "states"),
        ("[[:alpha:]]_proj", "POSIX class"),
        ("[a--z]_proj", "set operations"),
        (r"q_proj\Z", "write \\$"),
        (r"\u0071_proj", "RE2 cannot run it"),
        ("\ud800", "non-ASCII"),
        ("q_proj|[^\u00e9]", "non-ASCII"),
        (r"q_proj\z", "not a valid regex"),  # RE2's, not Python's: PEFT would fail on it
        ("(?<n>q)_proj", "the group"),  # RE2's named group; re knows only (?P<n>...)
    ],
)
def test_constructs_re_and_re2_read_differently_are_refused(pattern: str, reason: str) -> None:
    with pytest.raises(UnsupportedPattern, match=reason):
        LinearPattern(pattern)


PEFT_STYLE_PATTERNS = [
    "q_proj",
    "down_proj",
    "layers.1.self_attn.q_proj",
    "^model.layers.0.mlp.up_proj",
    r"mlp\..*_proj",
    r"model\.layers\.\d+\.self_attn\.(q|k|v)_proj",
    r"layers\.(0|1|2)\..*",
    r".*\.(gate|up)_proj",
    r"layers\.[0-9]{1,2}\.mlp\.down_proj$",
    r"(?:self_attn|mlp)\.\w+_proj",
    r"(?P<part>[qkvo])_proj",
    r"layers\.1[0-9]?\.self_attn\.[^.]+",
    r"\bq_proj",
    r"[a-z_]+\.o_proj",
    "k_proj|v_proj",
    "layers.1",
    "",
]
PEFT_STYLE_NAMES = [
    f"model.layers.{layer}.{parent}.{module}"
    for layer in (0, 1, 2, 10, 13)
    for parent, module in [
        ("self_attn", "q_proj"),
        ("self_attn", "k_proj"),
        ("self_attn", "v_proj"),
        ("self_attn", "o_proj"),
        ("mlp", "gate_proj"),
        ("mlp", "up_proj"),
        ("mlp", "down_proj"),
    ]
] + ["q_proj", "lm_head", "model.embed_tokens", "model.layers.1"]


@pytest.mark.parametrize("pattern", PEFT_STYLE_PATTERNS)
def test_ordinary_patterns_agree_with_re(pattern: str) -> None:
    matcher = LinearPattern(pattern)
    for name in PEFT_STYLE_NAMES:
        expected = re.fullmatch(rf"(.*\.)?({pattern})", name) is not None
        assert expected == _peft(pattern, name)
        assert matcher.matches(name) == expected, (pattern, name)


@pytest.mark.parametrize("name", ["", "q_proj\n", "a.b\nc.q_proj", "layers.\u0663.q_proj", "q\tproj"])
def test_names_where_re2_may_differ_are_refused(name: str) -> None:
    # RE2's \d \w \s \b are ASCII, re's $ also holds before a final newline: outside non-empty
    # printable ASCII (every name PEFT saves a LoRA weight under) an answer could differ.
    for pattern in ("q_proj", r"layers\.\d\.q_proj"):
        with pytest.raises(ValueError, match="printable ASCII"):
            LinearPattern(pattern).matches(name)
