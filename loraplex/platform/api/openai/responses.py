"""Response bodies of both endpoints, whole and as stream chunks.

A request with ``k`` prompts and ``n`` completions each runs as ``k`` engine requests;
its choices are numbered as OpenAI does: ``index = prompt_index * n + completion_index``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.platform.api.openai.logprobs import chat_logprobs, completion_logprobs
from loraplex.platform.api.openai.tools import ToolPlan
from loraplex.platform.api.token_text import TokenText
from loraplex.platform.engine.outputs import CompletionOutput, RequestOutput


def usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI's ``usage`` summed over the request's prompts (their whole, final outputs)."""
    return usage_of_counts(
        [
            (len(o.prompt_token_ids), o.num_cached_tokens, sum(len(c.token_ids) for c in o.outputs))
            for o in outputs
        ]
    )


def usage_of_counts(counts: list[tuple[int, int, int]]) -> dict[str, Any]:
    """OpenAI's ``usage`` of ``(prompt, cached, completion)`` tokens per prompt, summed."""
    prompt = sum(c[0] for c in counts)
    completion = sum(c[2] for c in counts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c[1] for c in counts)},
    }


@dataclass(frozen=True)
class ResponseShape:
    """How one request's outputs become OpenAI JSON (chat or completions)."""

    chat: bool
    request_id: str
    created: int
    model: str
    n: int
    num_top_logprobs: int | None
    """None when the request asked for no logprobs."""
    text_of: TokenText
    include_usage: bool = False
    """Streams only: send a final chunk with ``usage`` (``stream_options.include_usage``)."""
    tools: ToolPlan | None = None
    """Chat with tools that may be called: outputs are read for ``tool_calls`` (``openai.tools``)."""

    @property
    def calls_tools(self) -> bool:
        return self.tools is not None and self.tools.mode != "none"

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def choice_index(self, prompt_index: int, completion: CompletionOutput) -> int:
        return prompt_index * self.n + completion.index

    def logprobs(
        self, completion: CompletionOutput, start: int, end: int, text_offset: int
    ) -> tuple[Any, int]:
        """Logprobs of tokens ``[start:end)`` of ``completion`` (None when not requested), and
        the text offset after them (completions number tokens by their offset in the text)."""
        if self.num_top_logprobs is None or completion.logprobs is None:
            return None, text_offset
        ids, steps = completion.token_ids[start:end], completion.logprobs[start:end]
        if self.chat:
            content = chat_logprobs(self.text_of, ids, steps, self.num_top_logprobs)
            return {"content": content, "refusal": None}, text_offset
        legacy = completion_logprobs(self.text_of, ids, steps, text_offset)
        return legacy, text_offset + sum(map(len, legacy["tokens"]))

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        choices = []
        for p, out in enumerate(finals):
            for c in out.outputs:
                choice: dict[str, Any] = {
                    "index": self.choice_index(p, c),
                    "finish_reason": c.finish_reason,
                    "logprobs": self.logprobs(c, 0, len(c.token_ids), 0)[0],
                }
                if self.chat and self.calls_tools:
                    assert self.tools is not None
                    content, calls = self.tools.parse(c.text)
                    choice["message"] = {"role": "assistant", "content": content}
                    if calls:
                        choice["message"]["tool_calls"] = [call.body() for call in calls]
                        if c.finish_reason == "stop":
                            choice["finish_reason"] = "tool_calls"
                elif self.chat:
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    choice["text"] = c.text
                choice["stop_reason"] = c.stop_reason
                choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        return {
            "id": self.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(finals),
        }

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """One stream chunk; ``usage`` (``usage_of_counts``) makes it the final usage chunk."""
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return body

    def delta_choice(
        self, index: int, text: str, first: bool, finish_reason: str | None, logprobs: Any
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        return choice
