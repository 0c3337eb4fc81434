"""Streams carry deltas (``RequestOutputKind.DELTA``): what a client reads does not depend on how
far behind it was.

The same deltas are streamed once read as they come and once all posted before the reader reads
(the stream merges them): the text, the logprobs' tokens and offsets, the finish and the usage the
client assembles are the same; a step whose tokens have no text yet goes out with the next text;
a tool call read whole is parsed from all the pieces; ``MeteredStream`` accounts for every delta,
read or still pending.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from loraplex.platform.api.openai.responses import ResponseShape
from loraplex.platform.api.openai.streaming import sse_events
from loraplex.platform.api.openai.submission import MeteredStream
from loraplex.platform.api.openai.tool_parsers import PARSERS
from loraplex.platform.api.openai.tools import ToolPlan
from loraplex.platform.api.token_text import TokenText
from loraplex.platform.engine.outputs import CompletionOutput, Logprob, RequestOutput
from loraplex.platform.engine.request_stream import RequestStream

PROMPT = [1, 2, 3]


class _Tokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def _delta(index: int, text: str, tokens: list[int], finish: str | None = None) -> CompletionOutput:
    steps = [{t: Logprob(-0.5, 1, f"t{t}"), t + 1: Logprob(-1.5, 2, f"t{t + 1}")} for t in tokens]
    return CompletionOutput(index, text, list(tokens), -0.5 * len(tokens), steps, finish)


def _output(first: bool, completions: list[CompletionOutput], finished: bool = False) -> RequestOutput:
    return RequestOutput(
        "r",
        "p" if first else None,
        PROMPT if first else [],
        completions,
        finished,
        num_cached_tokens=2,
    )


def _deltas() -> list[RequestOutput]:
    """n=2: choice 0 has a step with a token and no text yet (an incomplete character), choice 1
    ends first and is absent from the outputs after its end."""
    return [
        _output(True, [_delta(0, "He", [10]), _delta(1, "A", [20])]),
        _output(False, [_delta(0, "", [11]), _delta(1, "B", [21])]),
        _output(False, [_delta(0, "llo", [12]), _delta(1, "", [22], "stop")]),
        _output(False, [_delta(0, " world", [13, 14])]),
        _output(False, [_delta(0, "!", [15], "length")], finished=True),
    ]


def _shape(chat: bool, tools: ToolPlan | None = None) -> ResponseShape:
    return ResponseShape(
        chat=chat,
        request_id="id",
        created=1,
        model="m",
        n=2,
        num_top_logprobs=1,
        text_of=TokenText(_Tokenizer()),
        include_usage=True,
        tools=tools,
    )


async def _events(shape: ResponseShape, outputs: list[RequestOutput], lag: bool) -> list[Any]:
    """The stream's events, read as each output comes or (``lag``) after all were posted."""
    stream = RequestStream(lambda _: None, "r", asyncio.get_running_loop(), aggregate=True)
    events: list[Any] = []
    if lag:
        for out in outputs:
            stream.post(out)
    else:

        async def feed() -> None:
            for out in outputs:
                stream.post(out)
                while stream.pending is not None:
                    await asyncio.sleep(0)

        feeding = asyncio.ensure_future(feed())
    async for event in sse_events(shape, [stream]):
        data = event.removeprefix("data: ").strip()
        events.append(data if data == "[DONE]" else json.loads(data))
    if not lag:
        await feeding
    return events


def _assembled(events: list[Any], chat: bool) -> dict[str | int, Any]:
    """What a client makes of the events: each choice's text, logprob tokens and offsets, finish."""
    got: dict[str | int, Any] = {"usage": None}
    for event in events[:-1]:
        if event.get("usage"):
            got["usage"] = event["usage"]
        for c in event["choices"]:
            mine = got.setdefault(c["index"], {"text": "", "tokens": [], "offsets": [], "finish": None})
            mine["text"] += (c["delta"].get("content") or "") if chat else c["text"]
            lp = c["logprobs"] or {}
            mine["tokens"] += [e["token"] for e in lp["content"]] if chat else lp.get("tokens", [])
            mine["offsets"] += lp.get("text_offset", [])
            mine["finish"] = c["finish_reason"] or mine["finish"]
    return got


def test_a_lagging_reader_reads_the_same_answer() -> None:
    for chat in (False, True):
        eager = asyncio.run(_events(_shape(chat), _deltas(), lag=False))
        lagging = asyncio.run(_events(_shape(chat), _deltas(), lag=True))
        assert len(lagging) == 3  # the whole answer in one chunk, the usage, [DONE]
        assert len(eager) > len(lagging) and eager[-1] == lagging[-1] == "[DONE]"
        got = _assembled(eager, chat)
        assert got == _assembled(lagging, chat)
        assert got[0]["text"] == "Hello world!" and got[1]["text"] == "AB"
        assert got[0]["tokens"] == [f"t{t}" for t in range(10, 16)]
        assert (got[0]["finish"], got[1]["finish"]) == ("length", "stop")
        if not chat:
            assert got[0]["offsets"] == [0, 3, 6, 9, 12, 15]  # by the tokens' texts, t10 ...
        assert got["usage"]["prompt_tokens"] == 3 and got["usage"]["completion_tokens"] == 9
        assert got["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_a_held_token_goes_out_with_the_next_text() -> None:
    events = asyncio.run(_events(_shape(False), _deltas(), lag=False))
    zero = [c for e in events[:-1] for c in e["choices"] if c["index"] == 0]
    assert [c["text"] for c in zero] == ["He", "llo", " world", "!"]
    assert zero[1]["logprobs"]["tokens"] == ["t11", "t12"]


def test_a_tool_call_read_whole_is_parsed_from_every_piece() -> None:
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    pieces = [call[:7], call[7:30], call[30:]]
    outputs = [
        _output(i == 0, [_delta(0, piece, [40 + i], "stop" if i == 2 else None)], finished=i == 2)
        for i, piece in enumerate(pieces)
    ]
    fn = {"name": "f", "description": "", "parameters": {"type": "object"}}
    plan = ToolPlan("auto", [fn], PARSERS["hermes"])
    for lag in (False, True):
        events = asyncio.run(_events(_shape(True, plan), outputs, lag))
        deltas = [c["delta"] for e in events[:-1] for c in e["choices"]]
        calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
        assert calls[0]["function"]["name"] == "f"
        assert json.loads("".join(tc["function"].get("arguments", "") for tc in calls)) == {"x": 1}
        assert [c["finish_reason"] for e in events[:-1] for c in e["choices"]][-1] == "tool_calls"


def test_metered_stream_counts_every_delta_read_or_pending() -> None:
    async def run() -> tuple[RequestOutput | None, RequestOutput | None, int]:
        inner = RequestStream(lambda _: None, "r", asyncio.get_running_loop(), aggregate=True)
        metered = MeteredStream(inner)
        outputs = _deltas()
        inner.post(outputs[0])
        first = await anext(metered)
        inner.post(outputs[1])
        await anext(metered)
        for out in outputs[2:]:  # a reader that stopped: pending, merged
            inner.post(out)
        assert first.outputs[0].text == "He"  # what the reader got is left as it was
        return metered.last, metered.latest, sum(len(c.token_ids) for c in first.outputs)

    last, latest, first_tokens = asyncio.run(run())
    assert first_tokens == 2
    assert last is not None and latest is not None
    assert [c.text for c in last.outputs] == ["He", "AB"] and not last.finished
    assert last.prompt_token_ids == PROMPT and [len(c.token_ids) for c in last.outputs] == [2, 2]
    assert [c.text for c in latest.outputs] == ["Hello world!", "AB"] and latest.finished
    assert [len(c.token_ids) for c in latest.outputs] == [6, 3]
    assert latest.prompt_token_ids == PROMPT
