"""``RequestOutputKind.DELTA``: each output carries only what is new, and the deltas add up.

For the same seeded request, the DELTA outputs merged (``RequestOutput.add``, as a lagging stream
merges them) hold exactly the CUMULATIVE final output's text, token ids, logprobs and finish;
each token is carried once, the prompt only by the first output, and a stop string that a later
token completes never cuts text a delta already carried. The offline ``LLM`` returns the whole
output for a DELTA request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.engines import tiny_engine

from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.outputs import RequestOutput
from loraplex.platform.engine.request_stream import RequestStream
from loraplex.platform.engine.sampling_params import RequestOutputKind, SamplingParams
from loraplex.platform.llm import LLM

PROMPT = [1, 17, 300, 42, 9]
SAMPLED: dict[str, Any] = dict(seed=7, n=2, max_tokens=48, temperature=1.0, logprobs=2)


@pytest.fixture(scope="module")
def engine(tiny_dirs: dict[str, Path]) -> Iterator[LLMEngine]:
    engine = tiny_engine(tiny_dirs, num_kv_blocks=64)
    yield engine
    engine.shutdown()


def _run(engine: LLMEngine, kind: RequestOutputKind, **kw: Any) -> list[RequestOutput]:
    """Every output of one request, in order."""
    rid = f"r{engine.next_request_id()}"
    engine.add_request(rid, PROMPT, SamplingParams(output_kind=kind, **kw))
    outs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def _merged(deltas: list[RequestOutput]) -> RequestOutput:
    whole = deltas[0].copy()
    for d in deltas[1:]:
        whole.add(d, aggregate=True)
    return whole


def _assert_same(got: RequestOutput, want: RequestOutput) -> None:
    assert got.finished and want.finished
    assert got.prompt_token_ids == want.prompt_token_ids == PROMPT
    assert len(got.outputs) == len(want.outputs)
    for g, w in zip(got.outputs, want.outputs, strict=True):
        assert (g.index, g.text, g.token_ids) == (w.index, w.text, w.token_ids)
        assert g.logprobs == w.logprobs
        assert g.cumulative_logprob == w.cumulative_logprob
        assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason)


def _stops(engine: LLMEngine) -> list[str]:
    """Two stop strings the seeded request's text holds (one spanning tokens, most likely)."""
    text = _run(engine, RequestOutputKind.CUMULATIVE, **SAMPLED)[-1].outputs[0].text
    return [text[20:23], text[35:37]]


def _cases(engine: LLMEngine) -> dict[str, dict[str, Any]]:
    stops = _stops(engine)
    return {
        "sampled n=2 with logprobs": SAMPLED,
        "greedy": dict(max_tokens=24, temperature=0.0),
        "stop strings": {**SAMPLED, "stop": stops},
        "stop strings kept in the output": {**SAMPLED, "stop": stops, "include_stop_str_in_output": True},
    }


@pytest.mark.slow
def test_delta_outputs_add_up_to_the_cumulative_output(engine: LLMEngine) -> None:
    for name, kw in _cases(engine).items():
        want = _run(engine, RequestOutputKind.CUMULATIVE, **kw)[-1]
        deltas = _run(engine, RequestOutputKind.DELTA, **kw)
        assert len(deltas) > 2, name
        _assert_same(_merged(deltas), want)
        # The prompt on the first output only; each token carried once; the finish once, last.
        assert deltas[0].prompt_token_ids == PROMPT
        assert all(d.prompt is None and d.prompt_token_ids == [] for d in deltas[1:]), name
        for w in want.outputs:
            mine = [c for d in deltas for c in d.outputs if c.index == w.index]
            assert sum(len(c.token_ids) for c in mine) == len(w.token_ids), name
            assert [c.finish_reason for c in mine if c.finish_reason] == [w.finish_reason], name
        if "stop" in kw:
            assert any(c.stop_reason in kw["stop"] for c in want.outputs), f"{name}: no stop string matched"


@pytest.mark.slow
def test_a_lagging_reader_gets_the_pending_deltas_merged(engine: LLMEngine) -> None:
    """Posted to a stream nobody reads, the outputs merge into one: the whole answer, nothing
    dropped (a CUMULATIVE stream would keep only the newest, which is whole by itself)."""
    want = _run(engine, RequestOutputKind.CUMULATIVE, **SAMPLED)[-1]
    deltas = _run(engine, RequestOutputKind.DELTA, **SAMPLED)
    first_text = deltas[0].outputs[0].text

    async def lag() -> list[RequestOutput]:
        stream = RequestStream(lambda _: None, "s", asyncio.get_running_loop(), aggregate=True)
        stream.post(deltas[0])
        read = [await anext(stream)]  # the first read on time; the rest pile up
        for d in deltas[1:]:
            stream.post(d)
        assert stream.num_coalesced == len(deltas) - 2
        read += [out async for out in stream]
        return read

    read = asyncio.run(lag())
    assert len(read) == 2 and read[0].outputs[0].text == first_text  # what was read stays as read
    _assert_same(_merged(read), want)


@pytest.mark.slow
def test_llm_generate_returns_whole_outputs_for_delta_requests(tiny_dirs: dict[str, Path]) -> None:
    llm = LLM(str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=64)
    try:
        default, delta = llm.generate(
            [PROMPT, PROMPT],
            [SamplingParams(**SAMPLED), SamplingParams(output_kind=RequestOutputKind.DELTA, **SAMPLED)],
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE  # vLLM's default
    _assert_same(delta, default)
