"""Streaming a tool-calling answer as OpenAI's ``delta.tool_calls`` chunks.

A named ``tool_choice`` streams as the tokens come: its output is the call's arguments, so the
first delta carries the call's id and name and every later one a piece of the arguments.
``"required"`` and ``"auto"`` answers are read whole (a parser needs the full text to tell a
call from prose), then sent as the content, if any, and one delta per call with its id and name
followed by its arguments in a few pieces, which clients concatenate as they do OpenAI's.
The stream hands each choice's text as deltas (``RequestOutputKind.DELTA``); an answer read whole
keeps its pieces until it ends (what was generated, once: no copy of the text so far per step).
"""

from __future__ import annotations

from typing import Any

from loraplex.platform.api.openai.tool_parsers import ToolCall
from loraplex.platform.api.openai.tools import ToolPlan, tool_call_deltas
from loraplex.platform.engine.outputs import CompletionOutput


class ToolStream:
    """The tool-call chunks of one streamed request, choice by choice."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._named: dict[int, ToolCall] = {}
        self._pieces: dict[int, list[str]] = {}  # an answer read whole: its text so far, by choice

    def choices(
        self, index: int, delta: str, first: bool, completion: CompletionOutput
    ) -> list[dict[str, Any]]:
        """The choice entries (one per chunk, in order) for the new ``delta`` of choice ``index``;
        ``completion`` says whether (and why) it finished (its text is not read: every piece of
        the choice's text comes as a ``delta``, in order)."""
        finished = completion.finished()
        finish = _finish(completion.finish_reason, called=True)
        if self.plan.streams_arguments:
            out: list[dict[str, Any]] = []
            call = self._named.get(index)
            if call is None:
                assert self.plan.named is not None
                call = self._named[index] = ToolCall(self.plan.named, "")
                head = {
                    "index": 0,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
                out.append(_choice(index, {"role": "assistant", "content": None, "tool_calls": [head]}))
            if delta:
                out.append(_choice(index, {"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}))
            if finished:
                out.append(_choice(index, {}, finish))
            return out
        pieces = self._pieces.setdefault(index, [])
        pieces.append(delta)
        if not finished:
            return []  # read whole: a parser needs the full text
        content, calls = self.plan.parse("".join(pieces))
        del self._pieces[index]
        out = [_choice(index, {"role": "assistant", "content": content or ("" if not calls else None)})]
        out.extend(_choice(index, {"tool_calls": d}) for d in tool_call_deltas(calls))
        out.append(_choice(index, {}, _finish(completion.finish_reason, called=bool(calls))))
        return out


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def _choice(index: int, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
