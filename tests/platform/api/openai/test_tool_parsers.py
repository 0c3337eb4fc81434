"""Tool calls read back per model family, tool plans, and the tools shown to the template."""

from __future__ import annotations

import json

import pytest

from loraplex.platform.api.errors import APIError
from loraplex.platform.api.openai.tool_parsers import PARSERS, parser_for_template, template_renders_tools
from loraplex.platform.api.openai.tools import plan_tools, response_format_constraint, tool_call_deltas
from loraplex.platform.api.routes.chat import _with_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


HERMES_ONE = 'Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
HERMES_TWO = (
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    '<tool_call>{"name": "g", "arguments": {"y": "é"}}</tool_call>'
)
MISTRAL = '[TOOL_CALLS][{"name": "f", "arguments": {"a": [1]}}]'
LLAMA_ONE = '{"name": "f", "parameters": {"q": "x"}}'
LLAMA_TWO = '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"k": 2}}'
BROKEN = "<tool_call>{not json</tool_call>"


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("hermes", HERMES_ONE, "Sure.", [("f", {"x": 1})]),
        ("hermes", HERMES_TWO, None, [("f", {}), ("g", {"y": "é"})]),
        ("hermes", "just text", "just text", []),
        ("hermes", BROKEN, BROKEN, []),
        ("mistral", MISTRAL, None, [("f", {"a": [1]})]),
        ("mistral", "no calls", "no calls", []),
        ("llama3_json", LLAMA_ONE, None, [("f", {"q": "x"})]),
        ("llama3_json", LLAMA_TWO, None, [("f", {}), ("g", {"k": 2})]),
        ("llama3_json", "The answer is 4.", "The answer is 4.", []),
    ],
)
def test_parsers_per_family(
    parser: str, text: str, content: str | None, calls: list[tuple[str, dict]]
) -> None:
    got_content, got = PARSERS[parser].parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got)


def test_parser_chosen_from_the_template() -> None:
    assert parser_for_template("{{ '<tool_call>' }}").name == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert parser_for_template("{{ '<|python_tag|>' }} ipython").name == "llama3_json"
    assert parser_for_template("{{ messages }}").name == "hermes"  # the default, with the system prompt


def test_tools_go_to_a_template_that_renders_them_else_to_the_system_prompt() -> None:
    qwen_like = "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}<tool_call>"
    plan = plan_tools([WEATHER], "auto", None, qwen_like)
    assert plan is not None and template_renders_tools(qwen_like)
    messages = [{"role": "user", "content": "hi"}]
    same, tools = _with_tools(messages, plan, qwen_like)
    assert same == messages and tools == plan.tools
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    shown, none = _with_tools([{"role": "system", "content": "Be brief."}, *messages], plan, plain)
    assert (
        none is None and shown[0]["content"].startswith("Be brief.") and "get_weather" in shown[0]["content"]
    )
    assert "<tool_call>" in shown[0]["content"] and shown[1:] == messages


def test_plans_and_their_grammars() -> None:
    required = plan_tools([WEATHER, TIME], "required", False, "")
    assert required is not None
    spec = required.constraint()
    assert spec is not None and spec.json is not None and spec.param == "tool_choice"
    assert isinstance(spec.json, dict) and spec.json["minItems"] == 1 and spec.json["maxItems"] == 1
    content, calls = required.parse('[{"name": "get_time", "parameters": {}}]')
    assert content is None and [c.name for c in calls] == ["get_time"]
    named = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, "")
    assert named is not None and named.constraint() is not None
    assert named.parse('{"city": "Oslo"}')[1][0].arguments == '{"city": "Oslo"}'
    none = plan_tools([WEATHER], "none", None, "")
    assert none is not None and not none.render and none.constraint() is None
    auto = plan_tools([WEATHER], None, None, "")
    assert auto is not None and auto.mode == "auto" and auto.constraint() is None
    # a call of a function that was not offered is not a tool call
    assert auto.parse('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>')[1] == []


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        (None, "required", "tool_choice"),
        ([WEATHER, WEATHER], None, "tools"),
        ([{"type": "retrieval"}], None, "tools.0"),
        ([WEATHER], "sometimes", "tool_choice"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            None,
            "tools.0.function.parameters",
        ),
    ],
)
def test_bad_tools_name_the_field(tools: list | None, choice: object, param: str) -> None:
    with pytest.raises(APIError) as info:
        plan_tools(tools, choice, None, "")
    assert info.value.status == 400 and info.value.param == param


def test_response_format_shapes() -> None:
    assert response_format_constraint(None) is None
    assert response_format_constraint({"type": "text"}) is None
    assert response_format_constraint({"type": "json_object"}).json_object is True  # type: ignore[union-attr]
    schema = {"type": "object"}
    spec = response_format_constraint({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert spec is not None and spec.json == schema
    for bad in (
        {"type": "yaml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": 3}},
    ):
        with pytest.raises(APIError):
            response_format_constraint(bad)


def test_streamed_deltas_concatenate_to_the_arguments() -> None:
    from loraplex.platform.api.openai.tool_parsers import ToolCall

    calls = [ToolCall("f", '{"a": 1, "b": "xyz"}'), ToolCall("g", "{}")]
    deltas = tool_call_deltas(calls)
    assembled: dict[int, str] = {}
    for d in deltas:
        for entry in d:
            assembled[entry["index"]] = assembled.get(entry["index"], "") + entry["function"]["arguments"]
    assert assembled == {0: calls[0].arguments, 1: calls[1].arguments}
    assert deltas[0][0]["id"] == calls[0].id and deltas[0][0]["function"]["name"] == "f"
