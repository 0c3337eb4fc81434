"""``tool_choice: "auto"`` through the server with a chat template that renders ``tools`` itself (as
Qwen's and Hermes' do): the tools reach the prompt through the template, and what the model
writes is read by the family's parser into ``tool_calls``, whole and streamed.

A tiny random model writes no tool call of its own will, so the answers are pinned with a
``guided_regex`` (vLLM's field; ``auto`` adds no grammar, so the two combine): once to the
Hermes call format, once to plain text. What is under test is everything around the model: the
template, the parser chosen from it, the answer's shape.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from loraplex.platform.api.app import build_app
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.settings import ServerSettings

# A Qwen-style template that shows the tools to the model in a <tools> block.
TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions. Their signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_REGEX = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    model = tmp_path_factory.mktemp("tools-template") / "model"
    shutil.copytree(tiny_dirs["gqa_tied"], model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").write_text(TEMPLATE)
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64)))
    with TestClient(build_app(engine, ServerSettings(served_model_name="tiny", single_tenant=True))) as c:
        yield c
    engine.shutdown()


def _chat(client: TestClient, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 60, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_the_template_renders_the_tools(client: TestClient) -> None:
    plain = _chat(client, max_tokens=1)
    with_tools = _chat(client, max_tokens=1, tools=[WEATHER])
    # The tools block (the function's JSON among it) is in the prompt: many more tokens.
    assert with_tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 30


def test_auto_reads_a_call_into_tool_calls(client: TestClient) -> None:
    data = _chat(client, tools=[WEATHER], tool_choice="auto", guided_regex=CALL_REGEX)
    (choice,) = data["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert not message.get("content")
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_auto_leaves_text_as_text(client: TestClient) -> None:
    data = _chat(client, tools=[WEATHER], tool_choice="auto", guided_regex="It is sunny in Paris")
    (choice,) = data["choices"]
    assert choice["message"]["content"] == "It is sunny in Paris"
    assert not choice["message"].get("tool_calls") and choice["finish_reason"] == "stop"


def test_auto_streams_the_call_as_deltas(client: TestClient) -> None:
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 60,
        "tools": [WEATHER],
        "guided_regex": CALL_REGEX,
        "stream": True,
    }
    name, arguments, finish = None, "", None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                for call in choice["delta"].get("tool_calls") or []:
                    name = call.get("function", {}).get("name") or name
                    arguments += call.get("function", {}).get("arguments") or ""
                finish = choice.get("finish_reason") or finish
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"} and finish == "tool_calls"
