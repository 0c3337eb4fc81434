"""Sampler and detokenizer against independent reference computations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.platform.detokenizer import IncrementalDetokenizer
from loraplex.platform.sampler import Sampler, apply_penalties, filter_logits
from loraplex.platform.sampling_params import SamplingParams


def naive_filter(logits: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Kept token ids, computed with plain Python loops (HF/vLLM semantics)."""
    import math

    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    kept = order[:top_k] if top_k > 0 else order
    m = max(logits[i] for i in kept)
    z = sum(math.exp(logits[i] - m) for i in kept)
    probs = {i: math.exp(logits[i] - m) / z for i in kept}
    nucleus, mass = [], 0.0
    for i in kept:
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += probs[i]
    top = probs[kept[0]]
    return {i for i in nucleus if probs[i] >= min_p * top or i == kept[0]}


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"),
    [(5, 1.0, 0.0), (-1, 0.7, 0.0), (10, 0.5, 0.0), (-1, 1.0, 0.2), (8, 0.9, 0.1), (1, 1.0, 0.0)],
)
def test_filter_matches_naive(top_k: int, top_p: float, min_p: float) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 40, generator=g) * 2
    out = filter_logits(
        logits.clone(),
        torch.tensor([top_k] * 4),
        torch.tensor([top_p] * 4),
        torch.tensor([min_p] * 4),
    )
    for r in range(4):
        kept = {i for i in range(40) if out[r, i] != float("-inf")}
        assert kept == naive_filter(logits[r].tolist(), top_k, top_p, min_p)
        for i in kept:
            assert out[r, i] == logits[r, i]


def test_penalties_match_reference() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    prompt, output = [0, 1], [3, 3, 4]
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    got = logits.clone()
    apply_penalties(got, p, prompt, output)
    expected = [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 0.5 - 0.25 * 2, -2.0 * 2 - 0.5 - 0.25, 1.0]
    assert got.tolist() == pytest.approx(expected)


def test_sampling_distribution_follows_probs() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    s = Sampler(torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0)
    counts = [0, 0, 0]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3000):
        counts[s.sample(logits, [p], [[]], [[]], [gen])[0].token_id] += 1
    assert counts[0] / 3000 == pytest.approx(0.5, abs=0.04)
    assert counts[2] / 3000 == pytest.approx(0.2, abs=0.04)


def test_greedy_with_repetition_penalty_avoids_repeat() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    s = Sampler(torch.Generator())
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert s.sample(logits, [p], [[0]], [[]], [None])[0].token_id == 1


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_incremental_detokenizer_streams_valid_utf8(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "Héllo wörld — 日本語のテキスト 🙂🚀 done."
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, prompt)
    pieces = []
    for t in ids:
        d.append(t)
        piece = d.take_delta(finished=False)
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(d.take_delta(finished=True))
    assert "".join(pieces) == text == d.text
    # Some character really was split across tokens, or this test proves nothing.
    assert len(ids) > len(text.encode()) / 4


def test_stop_string_spanning_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "alpha beta STOPWORD gamma"
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [], stop=["STOPWORD"])
    streamed = ""
    hit = None
    for t in ids:
        hit = d.append(t)
        streamed += d.take_delta(finished=hit is not None)
        if hit:
            break
    assert hit == "STOPWORD"
    assert d.text == "alpha beta "
    assert streamed == "alpha beta "
    # The stop word needs several tokens, so it really spans a boundary.
    assert len(tokenizer.encode(" STOPWORD", add_special_tokens=False)) > 1


def test_stop_string_included_when_asked(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [], stop=["o th"], include_stop_str_in_output=True)
    for t in ids:
        if d.append(t):
            break
    assert d.text == "one two th"
