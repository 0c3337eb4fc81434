"""Fuzzing the JSON request parser: any bytes give a request or a typed 400, in bounded time.

``parse_body`` is what the OpenAI routes run on a body (strict JSON, then the pydantic model).
Hypothesis feeds it arbitrary bytes, JSON documents of any shape (huge integers, deep nesting,
surrogate escapes) and mutations of valid requests. Allowed: a parsed request or an ``APIError``
with status 400; anything else, or a case over ``CASE_LIMIT_S``, fails.
"""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.platform.api.errors import APIError
from loraplex.platform.api.openai.json_body import parse_body
from loraplex.platform.api.openai.protocol import ChatCompletionRequest, CompletionRequest

CASE_LIMIT_S = 1.0
FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=30),
    st.sampled_from(["9" * 5000, "1e999", "-1e400", '"\\ud800"', '"\\udc00x"', '"\\ud83d\\ude00"', "[" * 50]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
fields = st.sampled_from(
    [
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "seed",
        "stop",
        "logprobs",
        "stream",
        "stream_options",
        "logit_bias",
        "user",
        "junk",
    ]
)


def _raw(value: object) -> str:
    # The sampled raw tokens (huge numbers, escapes) go in as JSON text, not as Python strings.
    if isinstance(value, str) and value.startswith(("9" * 10, "1e", "-1e", '"\\u', "[[")):
        return value
    if isinstance(value, list):
        return "[" + ",".join(_raw(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_raw(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["bytes", "object", "mutated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=512))
    obj = draw(st.dictionaries(fields, values, max_size=6))
    text = _raw(obj).encode()
    if kind == "mutated" and text:
        raw = bytearray(text)
        at = draw(st.integers(0, len(raw) - 1))
        raw[at] = draw(st.integers(0, 255))
        text = bytes(raw)
    return text


def _check(raw: bytes, model: type) -> None:
    started = time.monotonic()
    try:
        parse_body(raw, model)
    except APIError as exc:
        assert exc.status == 400, exc
    took_s = time.monotonic() - started
    assert took_s < CASE_LIMIT_S, f"a case took {took_s:.2f} s"


@pytest.mark.slow
@FUZZ
@given(raw=bodies())
def test_fuzz_completion_bodies(raw: bytes) -> None:
    _check(raw, CompletionRequest)


@pytest.mark.slow
@FUZZ
@given(raw=bodies())
def test_fuzz_chat_bodies(raw: bytes) -> None:
    _check(raw, ChatCompletionRequest)
