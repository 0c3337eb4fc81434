"""The ranking rule of beam search, HF transformers' (``generate(num_beams=W)``, its default
``early_stopping=False``): what one search step keeps, finishes and runs on.

Pure: it sees scores and token ids, never the engine. The offline search (``beam_search.py``:
beams are sequences forking block tables, all logits of a step in hand) and the server's
(``platform/api/openai/beam_search.py``: each beam's top logprobs from a one-token request, the
prompt and the common prefix served from the prefix cache) both call ``hf_search_step``, so the
same prompt gives the same beams on both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from loraplex.platform.engine.errors import InvalidParameterError

_NEG = -1.0e9  # HF's "ended" score offset: such a candidate never runs on


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` beams, up to ``max_tokens`` new tokens each."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name, low in (("beam_width", 1), ("max_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidParameterError(f"{name} must be an integer >= {low}, got {value!r}", param=name)
        if self.temperature != 0.0:
            # vLLM scales the logits before the log-softmax; HF's reference search has no
            # temperature. Refused rather than silently ignored.
            raise InvalidParameterError("beam search supports temperature=0 only", param="temperature")
        if not math.isfinite(self.length_penalty):
            raise InvalidParameterError("length_penalty must be finite", param="length_penalty")


@dataclass
class BeamSearchSequence:
    """One returned beam, as vLLM shapes it: ``tokens`` are prompt + generated ids, ``text`` the
    generated text (without a final EOS), ``cum_logprob`` the sum of its tokens' logprobs."""

    tokens: list[int]
    logprobs: list[float]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    score: float = 0.0
    """The ranking score, ``cum_logprob / gen_len ** length_penalty``."""


@dataclass
class BeamSearchOutput:
    """vLLM's ``BeamSearchOutput``: the best ``beam_width`` sequences, best first."""

    sequences: list[BeamSearchSequence]


def candidates_per_step(beam_width: int, num_eos: int) -> int:
    """How many (beam, token) candidates a search step ranks (HF's ``2 * W``, more with several
    EOS ids): enough that ``W`` of them run on however many end."""
    return max(2, 1 + num_eos) * beam_width


@dataclass(frozen=True)
class HypothesisBeam:
    """What a search step needs of a running beam: its tokens (prompt + generated), its
    tokens' logprobs, and how many it generated."""

    tokens: list[int]
    logprobs: list[float]
    num_generated: int


class SearchState(Protocol):
    """The part of a search a step changes: its finished hypotheses, and whether a running beam
    can still beat them."""

    finished: list[BeamSearchSequence]
    improvable: bool


def hf_search_step(
    search: SearchState,
    scored: list[tuple[float, int, int]],
    beams: list[HypothesisBeam],
    logprob_of: Callable[[int, int], float],
    params: BeamSearchParams,
    eos: tuple[int, ...],
    max_model_len: int,
) -> list[tuple[float, int, int, bool]] | None:
    """One step of HF's beam search over ``scored``, the best ``candidates_per_step`` (cumulative
    score, beam, token) over every beam, best first: the candidates that end become finished
    hypotheses when they rank among the first ``W``; the best ``W`` that do not end run on.
    Returns those (score, beam, token, False), or None when the search is over.

    Shared by the offline search (all logits of a step in hand) and the server's (each beam's
    top logprobs from a one-token request): the same ranking, so the same beams."""
    width = params.beam_width
    gen_len = beams[0].num_generated + 1  # every beam has the same length
    at_limit = gen_len >= params.max_tokens or len(beams[0].tokens) + 1 >= max_model_len
    cands = [(score, b, tok, at_limit or tok in eos) for score, b, tok in scored]
    if search.improvable:
        for rank, (score, b, tok, ends) in enumerate(cands):
            if ends and rank < width:
                beam = beams[b]
                search.finished.append(
                    BeamSearchSequence(
                        tokens=[*beam.tokens, tok],
                        logprobs=[*beam.logprobs, logprob_of(b, tok)],
                        cum_logprob=score,
                        finish_reason="length" if at_limit and tok not in eos else "stop",
                        score=score / gen_len**params.length_penalty,
                    )
                )
        search.finished.sort(key=lambda s: s.score, reverse=True)  # stable: earlier first on ties
        del search.finished[width:]
    # The best ``width`` candidates that do not end run on (HF's topk over "ended = -1e9").
    running = sorted(
        range(len(cands)), key=lambda r: cands[r][0] + (_NEG if cands[r][3] else 0.0), reverse=True
    )[:width]
    chosen = [cands[r] for r in running if not cands[r][3]]
    valid = not all(c[3] for c in cands)
    if chosen and len(search.finished) == width:
        best = chosen[0][0] / gen_len**params.length_penalty
        search.improvable = search.improvable and best > search.finished[-1].score
    if not (search.improvable and valid and chosen):
        return None
    return chosen
