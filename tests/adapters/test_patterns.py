"""``LinearPattern``: PEFT's pattern rule, matched without backtracking, exactly as ``re`` would."""

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
    "model.layers.0.self_attn.o_proj\n",
    "a.b\nc.q_proj",
    "",
]
ATOMS = ["q_proj", r"\.", ".", r"\d", "[a-z_]", "[^.]", "(a|q)", "mlp", "layers", "_", r"\b", "^", "$", "x"]


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
    try:
        re.compile(rf"(.*\.)?({pattern})$")
    except re.error:
        return
    try:
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
