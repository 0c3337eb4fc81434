"""Reading tool calls out of a model's text, one parser per model family (vLLM's names).

| parser | family | the model writes |
|---|---|---|
| ``hermes`` | Hermes, Qwen 2 / 2.5 / 3; the default | ``<tool_call>{"name", "arguments"}</tool_call>`` |
| ``mistral`` | Mistral | ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` |
| ``llama3_json`` | Llama 3.1 / 3.2 | ``{"name", "parameters"}`` (``<|python_tag|>``, ``;`` between) |

The family is read from the chat template's own tokens (``parser_for_template``). A template
that renders no tools (the bundled SmolLM2) gets the tools described in a system message in
the Hermes format (``tools_system_prompt``), and the Hermes parser.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    """One call as OpenAI returns it: ``arguments`` is a JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def body(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolParser(Protocol):
    name: str

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text outside calls, or None when there is none; the calls found)."""


def _call(name: Any, arguments: Any) -> ToolCall | None:
    if not isinstance(name, str) or not isinstance(arguments, dict | str):
        return None
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, text)


def _content(text: str) -> str | None:
    return text.strip() or None


class HermesParser:
    name = "hermes"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if "<tool_call>" not in text:
            return text, []
        calls = []
        for body in self._CALL.findall(text):
            try:
                obj = json.loads(body)
            except ValueError:
                return text, []
            call = (
                _call(obj.get("name"), obj.get("arguments", obj.get("parameters", {})))
                if isinstance(obj, dict)
                else None
            )
            if call is None:
                return text, []
            calls.append(call)
        return _content(text[: text.index("<tool_call>")]), calls


class MistralParser:
    name = "mistral"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if "[TOOL_CALLS]" not in text:
            return text, []
        before, _, after = text.partition("[TOOL_CALLS]")
        try:
            items = json.loads(after.strip())
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_call(i.get("name"), i.get("arguments", {})) for i in items if isinstance(i, dict)]
        if not calls or any(c is None for c in calls):
            return text, []
        return _content(before), [c for c in calls if c is not None]


class Llama3JsonParser:
    name = "llama3_json"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            while pos < len(body) and body[pos] in " \t\n;":  # calls are separated by "; "
                pos += 1
            call = (
                _call(obj.get("name"), obj.get("parameters", obj.get("arguments")))
                if isinstance(obj, dict)
                else None
            )
            if call is None:
                return text, []
            calls.append(call)
        return None, calls


PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), MistralParser(), Llama3JsonParser())}


def parser_for_template(chat_template: str) -> ToolParser:
    """The family's parser, told by the tokens its chat template writes."""
    if "[TOOL_CALLS]" in chat_template:
        return PARSERS["mistral"]
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return PARSERS["llama3_json"]
    return PARSERS["hermes"]


def template_renders_tools(chat_template: str) -> bool:
    """Whether the template itself shows ``tools`` to the model."""
    return re.search(r"\btools\b", chat_template) is not None


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The Hermes / Qwen tool prompt, for templates that render no tools."""
    listed = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
