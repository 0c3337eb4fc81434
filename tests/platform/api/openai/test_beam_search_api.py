"""``use_beam_search`` on ``/v1/completions`` (vLLM's extra): the server's search, run beside other
requests, returns the beams of the offline search (``LLM.beam_search``, itself checked against HF
transformers token for token in tests/platform/engine/test_beam_search.py)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from loraplex import LLM
from loraplex.platform.api.app import build_app
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.beam_search import BeamSearchParams
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.settings import ServerSettings

MODEL = "gqa_tied"


@pytest.fixture(scope="module")
def client(tiny_dirs: dict[str, Path]) -> Iterator[tuple[TestClient, LLMEngine]]:
    engine = LLMEngine(EngineConfig(model=str(tiny_dirs[MODEL]), dtype="float32", num_kv_blocks=128))
    aeng = AsyncEngine(engine)
    with TestClient(build_app(aeng, ServerSettings(served_model_name="tiny", single_tenant=True))) as c:
        yield c, engine
    aeng.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_dirs: dict[str, Path]) -> LLM:
    return LLM(model=str(tiny_dirs[MODEL]), dtype="float32", num_kv_blocks=128)


@pytest.mark.parametrize(
    ("width", "max_tokens", "length_penalty", "ignore_eos"),
    [(3, 7, 1.0, True), (4, 5, 0.5, False), (1, 4, 1.0, True)],
)
def test_server_beams_are_the_offline_beams(
    client: tuple[TestClient, LLMEngine],
    offline: LLM,
    width: int,
    max_tokens: int,
    length_penalty: float,
    ignore_eos: bool,
) -> None:
    c, engine = client
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [40, 41, 42]]
    body = {
        "model": "tiny",
        "prompt": prompts,
        "n": width,
        "max_tokens": max_tokens,
        "use_beam_search": True,
        "length_penalty": length_penalty,
        "ignore_eos": ignore_eos,
    }
    hits_before = engine.stats.prefix_cache.num_hit_tokens
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    params = BeamSearchParams(
        beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty, ignore_eos=ignore_eos
    )
    refs = offline.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    choices = sorted(data["choices"], key=lambda ch: ch["index"])
    for i, ref in enumerate(refs):
        got = [ch for ch in choices if ch["index"] // width == i]
        assert [ch["text"] for ch in got] == [s.text for s in ref.sequences], f"prompt {i}"
        assert [ch["finish_reason"] for ch in got] == [s.finish_reason for s in ref.sequences]
    completion_tokens = sum(
        len(s.tokens) - len(p) for ref, p in zip(refs, prompts, strict=True) for s in ref.sequences
    )
    # vLLM's accounting: each prompt once, the tokens of the beams returned.
    usage = data["usage"]
    assert usage["prompt_tokens"] == sum(len(p) for p in prompts)
    assert usage["completion_tokens"] == completion_tokens
    if max_tokens > 4:  # every step after the first re-reads the prompt's full blocks from the cache
        assert engine.stats.prefix_cache.num_hit_tokens > hits_before
    engine.check_integrity()


def test_other_requests_are_served_while_a_search_runs(client: tuple[TestClient, LLMEngine]) -> None:
    c, engine = client
    answers: dict[str, int] = {}

    def search() -> None:
        body = {"model": "tiny", "prompt": [9, 8, 7], "n": 4, "max_tokens": 24, "use_beam_search": True}
        answers["search"] = c.post("/v1/completions", json=body).status_code

    thread = threading.Thread(target=search)
    thread.start()
    plain = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    statuses = [c.post("/v1/completions", json=plain).status_code for _ in range(3)]
    thread.join(timeout=120)
    assert statuses == [200, 200, 200] and answers == {"search": 200}
    engine.check_integrity()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": True}, "stream"),
        ({"temperature": 0.7}, "temperature"),
        ({"logprobs": 2}, "logprobs"),
        ({"stop": ["x"]}, "stop"),
        ({"n": 0}, "n"),
        ({"n": 12}, "n"),  # 2 x 12 candidates per beam: over max_logprobs (20)
    ],
)
def test_fields_a_search_cannot_honour_are_refused(
    client: tuple[TestClient, LLMEngine], extra: dict[str, object], param: str
) -> None:
    c, _ = client
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 3, "use_beam_search": True, "n": 2, **extra}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_beams_are_the_offline_beams_of_the_templated_prompt(
    client: tuple[TestClient, LLMEngine], offline: LLM
) -> None:
    c, engine = client
    messages = [{"role": "user", "content": "Name three colours."}]
    body = {"model": "tiny", "messages": messages, "n": 3, "max_tokens": 5, "use_beam_search": True}
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = list(engine.tokenizer.encode(text, add_special_tokens=False))
    (ref,) = offline.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=5))
    got = [ch["message"]["content"] for ch in sorted(r.json()["choices"], key=lambda ch: ch["index"])]
    assert got == [s.text for s in ref.sequences]
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)


def test_tools_and_a_stray_length_penalty_are_refused(client: tuple[TestClient, LLMEngine]) -> None:
    c, _ = client
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "use_beam_search": True,
        "tools": [tool],
    }
    r = c.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "length_penalty": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"


@pytest.mark.slow
def test_beams_speculation_aborts_and_preemption_share_steps(tiny_dirs: dict[str, Path]) -> None:
    """On a server, beam searches are requests like any other: they run in the same steps as
    speculative ones and plain ones, in a pool tight enough to preempt, while other clients leave
    mid-answer. The pool holds together throughout (checked on the engine thread as it runs) and
    is empty at the end; every search still returns the offline search's beams."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    config = EngineConfig(
        model=str(tiny_dirs[MODEL]),
        dtype="float32",
        num_kv_blocks=12,
        block_size=8,
        max_num_batched_tokens=32,
        max_num_seqs=16,
        speculative_config=json.dumps({**spec, "disable_by_batch_size": None}),
    )
    engine = LLMEngine(config)
    aeng = AsyncEngine(engine)
    app = build_app(aeng, ServerSettings(served_model_name="tiny", single_tenant=True))
    rng = random.Random(5)
    copy = [7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12, 7, 8, 9]  # ngram drafts find their continuation
    searches = [[rng.randrange(3, 4000) for _ in range(rng.randrange(3, 20))] for _ in range(4)]
    checks: list[int] = []
    failures: list[str] = []

    async def check_while_running(stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await aeng.inspect(lambda e: e.check_integrity())
                checks.append(1)
            except AssertionError as exc:  # pragma: no cover - what the test is for
                failures.append(str(exc))
            await asyncio.sleep(0.005)

    async def main() -> list[list[str]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:
            stop = asyncio.Event()
            checker = asyncio.ensure_future(check_while_running(stop))

            async def search(prompt: list[int]) -> list[str]:
                body = {"model": "tiny", "prompt": prompt, "n": 3, "max_tokens": 6, "use_beam_search": True}
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return [ch["text"] for ch in sorted(r.json()["choices"], key=lambda ch: ch["index"])]

            async def speculative(i: int) -> None:
                body = {
                    "model": "tiny",
                    "prompt": copy,
                    "max_tokens": 12 + i,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text

            async def abandoned() -> None:  # a client that gives up mid-answer
                body = {"model": "tiny", "prompt": copy, "max_tokens": 40, "ignore_eos": True}
                task = asyncio.ensure_future(client.post("/v1/completions", json=body))
                await asyncio.sleep(0.05)
                task.cancel()

            work = (
                [search(p) for p in searches]
                + [speculative(i) for i in range(4)]
                + [abandoned() for _ in range(3)]
            )
            results = await asyncio.gather(*work, return_exceptions=True)
            stop.set()
            await checker
        errors = [
            r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)
        ]
        assert not errors, errors
        return [r for r in results[: len(searches)] if isinstance(r, list)]

    try:
        beams = asyncio.run(main())
        polls = 0  # the abandoned requests' aborts land on the engine thread
        while asyncio.run(aeng.inspect(lambda e: e.has_unfinished_requests())) and polls < 200:
            polls += 1
        assert not failures, failures[:3]
        assert len(checks) > 10
        counts = asyncio.run(
            aeng.inspect(lambda e: (e.scheduler.num_preemptions, e.speculator.counters.num_drafts))
        )
        assert counts[0] > 0 and counts[1] > 0, counts  # the pool preempted, speculation drafted
        asyncio.run(aeng.inspect(lambda e: e.check_integrity()))
    finally:
        aeng.shutdown()
    offline = LLM(model=str(tiny_dirs[MODEL]), dtype="float32", num_kv_blocks=128)
    refs = offline.beam_search(
        [{"prompt_token_ids": p} for p in searches], BeamSearchParams(beam_width=3, max_tokens=6)
    )
    assert beams == [[s.text for s in ref.sequences] for ref in refs]


def test_a_search_that_ends_early_leaves_its_beams_so_far(tiny_dirs: dict[str, Path]) -> None:
    """A search cancelled mid-way (the client left) has its running beams in ``BeamProgress``:
    what the server counts as its usage (the prompt and each beam's tokens so far), as an
    aborted plain request counts what it generated."""
    from loraplex.platform.api.openai.beam_search import BeamProgress, beam_search
    from loraplex.platform.api.state import app_state
    from loraplex.platform.api.tenancy.tenant_gate import tokens_used

    engine = LLMEngine(EngineConfig(model=str(tiny_dirs[MODEL]), dtype="float32", num_kv_blocks=128))
    aeng = AsyncEngine(engine)
    state = app_state(build_app(aeng, ServerSettings(served_model_name="tiny", single_tenant=True)))
    progress = BeamProgress()
    prompt = [1, 57, 58, 59, 60]
    params = BeamSearchParams(beam_width=3, max_tokens=40, ignore_eos=True)

    async def main() -> None:
        search = asyncio.ensure_future(beam_search(state, "b", [prompt], params, None, None, 1.0, progress))
        while not progress.outputs or len(progress.outputs[0].outputs[0].token_ids) < 3:
            assert not search.done()
            await asyncio.sleep(0.005)
        search.cancel()
        with pytest.raises(asyncio.CancelledError):
            await search

    try:
        asyncio.run(main())
    finally:
        aeng.shutdown()
    (out,) = progress.so_far()
    assert out.prompt_token_ids == prompt and not out.finished
    assert len(out.outputs) == 3 and all(3 <= len(c.token_ids) < 40 for c in out.outputs)
    prompt_tokens, _, completion_tokens = tokens_used(progress.so_far())
    assert prompt_tokens == len(prompt) and completion_tokens == sum(len(c.token_ids) for c in out.outputs)
