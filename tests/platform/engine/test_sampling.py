"""Sampler and detokenizer against independent reference computations."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from loraplex.platform.engine.detokenizer import IncrementalDetokenizer
from loraplex.platform.engine.errors import InvalidParameterError
from loraplex.platform.engine.sampler import NonFiniteLogitsError, Sampler, apply_penalties, filter_logits
from loraplex.platform.engine.sampling_params import SamplingParams

NAN, INF = float("nan"), float("inf")


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


@pytest.mark.slow
def test_draws_pass_a_chi_square_test_and_never_pick_a_banned_token() -> None:
    """The inverse-transform draw against the softmax over 200 tokens, a quarter of them banned:
    Pearson's chi-square over 40,000 draws stays under its 99.9th percentile for 149 degrees of
    freedom (about 205), and no banned token is ever drawn."""
    vocab, draws = 200, 40_000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(7))
    banned = torch.arange(vocab) % 4 == 3
    logits[0, banned] = -INF
    probs = logits.softmax(dim=-1)[0]
    s = Sampler(torch.Generator())
    p = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(11)
    batch = 100  # rows of one step share the draw's cumsum and search
    counts = torch.zeros(vocab)
    for _ in range(draws // batch):
        for r in s.sample(logits.expand(batch, -1), [p] * batch, [[]] * batch, [[]] * batch, [gen] * batch):
            counts[r.token_id] += 1
    assert counts[banned].sum() == 0
    expected = probs[~banned] * draws
    chi2 = float(((counts[~banned] - expected) ** 2 / expected).sum())
    assert chi2 < 205, chi2


def test_a_seeded_row_draws_the_same_token_whatever_its_neighbours() -> None:
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=0.8, top_p=0.9)
    s = Sampler(torch.Generator().manual_seed(0))
    alone = [
        s.sample(logits[i : i + 1], [p], [[]], [[]], [torch.Generator().manual_seed(i)])[0] for i in range(4)
    ]
    together = s.sample(
        logits, [p] * 4, [[]] * 4, [[]] * 4, [torch.Generator().manual_seed(i) for i in range(4)]
    )
    assert [r.token_id for r in together] == [r.token_id for r in alone]


def test_greedy_with_repetition_penalty_avoids_repeat() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    s = Sampler(torch.Generator())
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert s.sample(logits, [p], [[0]], [[]], [None])[0].token_id == 1


# (field, bad value): every one must raise InvalidParameterError naming the field.
INVALID: list[tuple[str, Any]] = [
    *[("temperature", v) for v in (NAN, INF, -INF, -0.5, "1.0", True, None, 10**400)],
    *[("top_p", v) for v in (NAN, 0.0, 1.5, INF, -0.1)],
    *[("min_p", v) for v in (NAN, -0.1, 1.1)],
    *[("repetition_penalty", v) for v in (NAN, 0.0, -1.0, INF)],
    *[("presence_penalty", v) for v in (NAN, 2.5, INF, -INF)],
    *[("frequency_penalty", v) for v in (NAN, -3.0, -INF)],
    *[("top_k", v) for v in (-2, 2**63, -(2**70), 1.5, True, "5", None)],
    *[("seed", v) for v in (2**64, -(2**63) - 1, 1.0, True, "7")],
    *[("n", v) for v in (0, -1, True, 1.0, 2**70)],
    *[("max_tokens", v) for v in (0, -1, 1.5, True, 2**64)],
    *[("min_tokens", v) for v in (-1, 1.5, False)],
    *[("logprobs", v) for v in (-1, 1.5, True, 2**64, "5")],
    *[("stop", v) for v in ("", [""], [1], 5, {"a"}, ["ok", None])],
    *[("stop_token_ids", v) for v in ([-1], [1.5], [2**63], "12", [True], 5)],
    *[
        (f, v)
        for f in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
        for v in (1, "yes")
    ],
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}"[:40] for f, v in INVALID])
def test_params_refuse_invalid_values(field: str, value: Any) -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)  # offline callers that caught ValueError keep working


def test_min_tokens_over_max_tokens_is_refused() -> None:
    with pytest.raises(InvalidParameterError, match=r"min_tokens \(5\) must be <= max_tokens \(3\)") as info:
        SamplingParams(min_tokens=5, max_tokens=3)
    assert info.value.param == "min_tokens"


def test_params_message_names_the_allowed_range() -> None:
    with pytest.raises(
        InvalidParameterError, match=r"seed must be in \[-9223372036854775808, 18446744073709551615\]"
    ):
        SamplingParams(seed=2**64)
    with pytest.raises(InvalidParameterError, match=r"temperature must be a finite number >= 0, got nan"):
        SamplingParams(temperature=NAN)


def test_params_accept_and_normalise_edge_values() -> None:
    p = SamplingParams(
        temperature=1,
        top_k=2**63 - 1,
        seed=2**64 - 1,
        max_tokens=np.int64(5),  # type: ignore[arg-type]
        presence_penalty=np.float32(-2.0),  # type: ignore[arg-type]
        stop=("a", "bc"),  # type: ignore[arg-type]
        stop_token_ids=[0, 2**63 - 1],
        logprobs=10**6,
    )
    assert type(p.temperature) is float and p.temperature == 1.0
    assert type(p.max_tokens) is int and p.max_tokens == 5
    assert type(p.presence_penalty) is float
    assert p.stop_strings == ["a", "bc"]
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    for seed in (-(2**63), 2**64 - 1):  # the seed range is torch's own
        torch.Generator().manual_seed(seed)
    assert SamplingParams(top_k=0).greedy is False
    # vLLM: a temperature below 1e-5 is greedy; just above it, sampling (which must stay finite).
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=2e-5).greedy


@pytest.mark.parametrize("temperature", [1e-40, 1e-6, 2e-5, 1e-4])
def test_tiny_temperatures_pick_the_top_token(temperature: float) -> None:
    # The last row's logits divided by the temperature overflow float32 unless shifted first.
    logits = torch.tensor(
        [[1.0, 900.0, 899.9, -1e30, 0.0], [3.0, 2.0, 1.0, 3.5, -INF], [3e35, 2e35, -3e38, 3e35 - 1e30, 0.0]]
    )
    s = Sampler(torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=temperature, logprobs=2)
    for _ in range(20):
        res = s.sample(logits, [p] * 3, [[]] * 3, [[]] * 3, [None] * 3)
        assert [r.token_id for r in res] == [1, 3, 0]
        assert all(math.isfinite(r.logprob) for r in res)


def test_huge_temperature_is_uniform_and_keeps_banned_tokens_out() -> None:
    logits = torch.tensor([[5.0, -INF, 0.0, -3.0, -INF, 1e30]])
    s = Sampler(torch.Generator())
    p = SamplingParams(temperature=1e300)
    gen = torch.Generator().manual_seed(3)
    counts = [0] * 6
    for _ in range(800):
        counts[s.sample(logits, [p], [[]], [[]], [gen])[0].token_id] += 1
    assert counts[1] == counts[4] == 0
    for t in (0, 2, 3, 5):
        assert counts[t] / 800 == pytest.approx(0.25, abs=0.06)


def test_top_k_and_logprobs_beyond_the_vocab_mean_all() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 30, generator=g)
    s = Sampler(torch.Generator())
    huge = SamplingParams(temperature=1.0, top_k=2**63 - 1, logprobs=100_000)
    off = SamplingParams(temperature=1.0, top_k=-1, logprobs=100_000)
    got = s.sample(
        logits, [huge, huge], [[], []], [[], []], [torch.Generator().manual_seed(i) for i in (1, 2)]
    )
    want = s.sample(
        logits, [off, off], [[], []], [[], []], [torch.Generator().manual_seed(i) for i in (1, 2)]
    )
    assert [r.token_id for r in got] == [r.token_id for r in want]
    for r in got:
        assert r.top_logprobs is not None and len(r.top_logprobs) == 30


def test_non_finite_rows_are_named_before_any_draw() -> None:
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    logits[1, 3] = NAN
    logits[2, 0] = INF
    logits[3] = -INF
    logits[4, :4] = -INF  # partly banned: fine
    p = SamplingParams(temperature=1.0, seed=1)
    gens = [torch.Generator().manual_seed(i) for i in range(5)]
    states = [g.get_state().clone() for g in gens]
    s = Sampler(torch.Generator())
    with pytest.raises(NonFiniteLogitsError) as info:
        s.sample(logits, [p] * 5, [[]] * 5, [[]] * 5, list(gens))
    assert info.value.rows == [1, 2, 3]
    assert isinstance(info.value, RuntimeError)
    assert all(torch.equal(g.get_state(), st) for g, st in zip(gens, states, strict=True))
    # The caller drops those rows and samples the rest: the tokens it would have drawn anyway.
    keep = [0, 4]
    res = s.sample(logits[keep], [p] * 2, [[]] * 2, [[]] * 2, [gens[i] for i in keep])
    again = s.sample(
        logits[keep], [p] * 2, [[]] * 2, [[]] * 2, [torch.Generator().manual_seed(i) for i in keep]
    )
    assert [r.token_id for r in res] == [r.token_id for r in again]
    assert res[1].token_id >= 4


@pytest.mark.parametrize("penalty", [1e-300, 1e-45, 1e-30, 1e30, 1e300])
def test_extreme_repetition_penalty_stays_finite(penalty: float) -> None:
    logits = torch.tensor([3e38, -3e38, 0.0, 2.0, -INF, 1.0])
    p = SamplingParams(repetition_penalty=penalty, temperature=0.7)
    got = logits.clone()
    apply_penalties(got, p, [0, 1, 2, 3, 4], [])
    assert not bool(got.isnan().any())
    assert got[4] == -INF  # a banned token stays banned
    assert bool(torch.isfinite(got[[0, 1, 2, 3, 5]]).all())
    s = Sampler(torch.Generator().manual_seed(0))
    for _ in range(20):
        assert s.sample(logits[None], [p], [[0, 1, 2, 3, 4]], [[]], [None])[0].token_id != 4


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


def test_greedy_tokens_first_maximum_as_torch() -> None:
    """numpy's argmax on the CPU: the first maximum of each row, as torch's argmax."""
    from loraplex.platform.engine.sampler import greedy_tokens

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=gen)
    logits[1, 7] = logits[1, 900] = 50.0  # a tie: the first one wins
    logits[2] = -1.0  # all equal
    for rows in (logits, logits[::2], logits[:, 10:]):  # strided views too
        got = greedy_tokens(rows)
        assert got.dtype == torch.int64
        assert torch.equal(got, rows.argmax(dim=-1))
    assert greedy_tokens(logits)[1] == 7 and greedy_tokens(logits)[2] == 0
