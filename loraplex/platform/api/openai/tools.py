"""Tool calling: ``tools`` and ``tool_choice`` checked, turned into a grammar where the choice
is forced, and the model's output read back as OpenAI ``tool_calls``.

| ``tool_choice`` | grammar | how the output is read |
|---|---|---|
| ``"none"`` | none; tools not shown | text |
| a named function | its ``parameters`` schema | the output is the arguments |
| ``"required"`` | a JSON array of ``{"name", "parameters"}`` (vLLM's), ``minItems`` 1 | each item a call |
| ``"auto"`` (default with tools) | none | the model family's parser (``parsers``) |

``"required"`` and named choices always parse: the grammar admits nothing else. ``"auto"`` is
the model's decision; the parser finds calls in its own format or returns the text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from loraplex.platform.api.errors import APIError, bad_request
from loraplex.platform.api.openai.tool_parsers import ToolCall, ToolParser, parser_for_template
from loraplex.platform.engine.sampling_params import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_TOOLS = 128
"""Most entries in ``tools``."""

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """What a request's ``tools`` / ``tool_choice`` ask for (``plan_tools``)."""

    mode: Mode
    tools: list[dict[str, Any]]
    """The function definitions (``{"name", "description", "parameters"}``)."""
    parser: ToolParser
    named: str | None = None
    parallel: bool = True

    @property
    def render(self) -> bool:
        """Whether the prompt shows the tools (not for ``"none"``)."""
        return self.mode != "none" and bool(self.tools)

    @property
    def streams_arguments(self) -> bool:
        """A named call's output is its arguments: stream them as they come."""
        return self.mode == "named"

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that enforces a ``required`` or named choice (None otherwise)."""
        if self.mode == "named":
            fn = next(t for t in self.tools if t["name"] == self.named)
            return StructuredOutputsParams(json=_parameters(fn), param="tool_choice")
        if self.mode == "required":
            items = [
                {
                    "type": "object",
                    "properties": {"name": {"const": t["name"]}, "parameters": _parameters(t)},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema, param="tool_choice")
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) read from a whole output."""
        if self.mode == "none" or not self.tools:
            return text, []
        if self.mode == "named":
            assert self.named is not None
            return None, [ToolCall(self.named, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []  # cut by max_tokens: the text as it is (finish_reason "length")
            return None, [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
        content, calls = self.parser.parse(text)
        known = {t["name"] for t in self.tools}
        calls = [c for c in calls if c.name in known]
        if not self.parallel:
            calls = calls[:1]
        return content, calls


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def plan_tools(
    tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None, chat_template: str
) -> ToolPlan | None:
    """Check ``tools`` and ``tool_choice`` (400 naming the field); None without tools."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' requires 'tools'.", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise bad_request(
            f"'tools' has {len(tools)} entries, over this server's limit of {MAX_TOOLS}.", "tools"
        )
    functions = [_function(i, t) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("Function names in 'tools' must be unique.", "tools")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    parser = parser_for_template(chat_template)
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan("auto", functions, parser, parallel=parallel)
    if tool_choice in ("none", "required"):
        return ToolPlan(tool_choice, functions, parser, parallel=parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise bad_request(
                f"'tool_choice' names the function {name!r}, which is not in 'tools'.", "tool_choice"
            )
        return ToolPlan("named", functions, parser, named=name, parallel=parallel)
    raise bad_request(
        "'tool_choice' must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}.",
        "tool_choice",
    )


def _function(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools.{i}"
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise bad_request("Each tool must be {'type': 'function', 'function': {...}}.", where)
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(
            "A function name must be 1-64 characters of letters, digits, '_', '.' or '-'.",
            f"{where}.function.name",
        )
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request("'parameters' must be a JSON schema object.", f"{where}.function.parameters")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request("'description' must be a string.", f"{where}.function.description")
    out: dict[str, Any] = {"name": name, "parameters": _parameters(fn)}
    if description:
        out["description"] = description
    return out


def response_format_constraint(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """The constraint of OpenAI's ``response_format`` (None for text); 400 for a bad shape."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, param="response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                "'response_format.json_schema' must be an object {'name', 'schema', 'strict'}.",
                "response_format.json_schema",
            )
        schema = spec.get("schema", {"type": "object"})  # OpenAI: the schema is optional
        if not isinstance(schema, dict):
            raise bad_request(
                "'response_format.json_schema.schema' must be a JSON schema object.", "response_format"
            )
        return StructuredOutputsParams(json=schema, param="response_format")
    raise bad_request(
        f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
        "response_format",
    )


def tool_call_deltas(calls: list[ToolCall], pieces: int = 4) -> list[list[dict[str, Any]]]:
    """OpenAI's streamed ``delta.tool_calls`` for whole calls: per call, a first delta with id,
    type, name and empty arguments, then the arguments in ``pieces`` parts (clients concatenate)."""
    deltas: list[list[dict[str, Any]]] = []
    for k, call in enumerate(calls):
        deltas.append(
            [
                {
                    "index": k,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            ]
        )
        step = max(1, -(-len(call.arguments) // pieces))
        for start in range(0, len(call.arguments), step):
            deltas.append([{"index": k, "function": {"arguments": call.arguments[start : start + step]}}])
    return deltas


def refuse_conflicts(plan: ToolPlan | None, response_format: StructuredOutputsParams | None) -> None:
    """A forced tool call and a response format are two grammars for one output: refused."""
    if plan is not None and plan.constraint() is not None and response_format is not None:
        raise APIError(
            400,
            "'response_format' cannot be combined with a required or named 'tool_choice'.",
            param="response_format",
            code="invalid_value",
        )
