"""OpenAI-compatible request bodies (strict JSON types) and the fields this server refuses.

Unknown fields are accepted and ignored (clients send many harmless ones), but the
OpenAI fields that would change the answer and are not implemented are refused with
a 400 naming them, never silently dropped (``unsupported_field``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplex.platform.api.errors import APIError, bad_request, unsupported
from loraplex.platform.engine.beam_rule import BeamSearchParams
from loraplex.platform.engine.errors import InvalidParameterError
from loraplex.platform.engine.inputs import PromptType


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by both endpoints (vLLM's extra sampling fields included)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, Any] | None = None
    # vLLM's guided decoding fields (structured outputs); at most one of them
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's beam search extras: ``n`` beams (both endpoints; openai/beam_search.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _refuse_common(self) -> APIError | None:
        if self.logit_bias:
            return unsupported("logit_bias")
        return None

    def beam_search_params(self, max_tokens: int | None) -> BeamSearchParams | None:
        """With ``use_beam_search``: its ``BeamSearchParams`` (``n`` beams of up to ``max_tokens``,
        greedy), or a 400 naming a field the search cannot honour (refused, never ignored); None
        without it."""
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise bad_request(
                    "length_penalty applies to beam search only (use_beam_search).", "length_penalty"
                )
            return None
        given = self.model_fields_set
        # The sampling fields a greedy search has no use for: refused when set to anything else.
        defaults = {
            "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "stream": False,
        }  # fmt: skip
        for name, default in defaults.items():
            if name in given and getattr(self, name) != default:
                value = getattr(self, name)
                raise bad_request(
                    f"use_beam_search does not take {name}={value!r} (beam search is greedy "
                    "and answers whole).",
                    name,
                )
        for name in ("stop", "stop_token_ids", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar", "logprobs", "response_format", "tools"):  # fmt: skip
            if getattr(self, name, None):
                raise bad_request(f"use_beam_search does not take {name}.", name)
        if max_tokens is None:
            raise bad_request("use_beam_search needs max_tokens.", "max_tokens")
        try:
            return BeamSearchParams(
                beam_width=self.n,
                max_tokens=max_tokens,
                ignore_eos=self.ignore_eos,
                length_penalty=self.length_penalty,
            )
        except InvalidParameterError as exc:
            raise bad_request(exc.message, "n" if exc.param == "beam_width" else exc.param) from None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: Any = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None

    def prompts(self) -> list[PromptType]:
        """The prompts as a list (OpenAI accepts one prompt or a list of them)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p:
            if all(_is_token_id(t) for t in p):
                return [list(p)]
            if all(isinstance(t, str) for t in p):
                return list(p)
            if all(isinstance(t, list) and all(_is_token_id(x) for x in t) for t in p):
                return [list(t) for t in p]
        if p is None:
            raise bad_request("Missing required parameter: 'prompt'.", "prompt")
        raise bad_request(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists (non-empty).",
            "prompt",
        )

    def unsupported_field(self) -> APIError | None:
        if self.echo:
            return unsupported("echo")
        if self.suffix:
            return unsupported("suffix")
        if self.best_of is not None and self.best_of != self.n:
            return unsupported("best_of", "(other than best_of == n)")
        return self._refuse_common()


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None

    def text_messages(self) -> list[dict[str, Any]]:
        """Messages for the chat template; content parts other than text are refused. An
        assistant's ``tool_calls`` and a tool message's ``tool_call_id`` go to the template too."""
        out = []
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                texts = []
                for j, part in enumerate(m.content):
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise bad_request(
                            "Only text content parts ({'type': 'text', 'text': ...}) are supported.",
                            f"messages.{i}.content.{j}",
                        )
                    texts.append(part["text"])
                content = "".join(texts)
            else:
                content = m.content or ""
            message: dict[str, Any] = {"role": m.role, "content": content}
            extra = m.model_extra or {}
            for key in ("tool_calls", "tool_call_id", "name"):
                if key in extra:
                    message[key] = extra[key]
            out.append(message)
        return out

    def unsupported_field(self) -> APIError | None:
        if self.functions:
            return unsupported("functions")
        if self.function_call not in (None, "none"):
            return unsupported("function_call")
        if self.audio is not None:
            return unsupported("audio")
        if self.prediction is not None:
            return unsupported("prediction")
        return self._refuse_common()
