"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``.

Everything a request carries is checked here, on its own, before the request
touches the engine: types (a ``bool`` is not an ``int``), ranges, finiteness
(``NaN`` passes every ``<`` comparison, so it is tested for explicitly) and int64
bounds (the values end up in torch tensors and generators). Checks that need the
engine (``n`` against ``max_num_seqs``, ``logprobs`` against ``max_logprobs``,
token ids against the vocabulary, prompt + ``max_tokens`` against the context)
live in ``LLMEngine.add_request``. Every failure raises ``InvalidParameterError``
with ``param`` naming the field.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

from loraplex.platform.engine.errors import InvalidParameterError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
SEED_MIN = -(2**63)
"""``torch.Generator.manual_seed`` takes [-2**63, 2**64 - 1] (negative seeds wrap)."""
SEED_MAX = 2**64 - 1
SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy, as in vLLM: dividing logits by a tinier one
only turns the softmax into an argmax through overflow."""


def _int(name: str, value: object, low: int, high: int = INT64_MAX, what: str = "") -> int:
    """``value`` as an int in [low, high]; bools and floats are refused (``True`` is not 1)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise InvalidParameterError(
            f"{name} must be an integer in [{low}, {high}]{what}, got {value!r}", param=name
        )
    number = int(value)
    if not low <= number <= high:
        raise InvalidParameterError(f"{name} must be in [{low}, {high}]{what}, got {number}", param=name)
    return number


def _float(name: str, value: object, allowed: str) -> float:
    """``value`` as a finite float (ints welcome); ``allowed`` is the range for the message."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise InvalidParameterError(f"{name} must be a number {allowed}, got {value!r}", param=name)
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        number = math.inf
    if not math.isfinite(number):
        raise InvalidParameterError(f"{name} must be a finite number {allowed}, got {value!r}", param=name)
    return number


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidParameterError(f"{name} must be true or false, got {value!r}", param=name)
    return value


class RequestOutputKind(enum.Enum):
    """What each output of a request carries (vLLM's ``RequestOutputKind``, same values).

    ``CUMULATIVE``: every output holds all the text, tokens and logprobs so far (the offline
    API's default). ``DELTA``: every output holds only what is new since the request's last
    output: ``CompletionOutput.text``, ``token_ids`` and ``logprobs`` are the new part (the text
    holds back a possible stop-string prefix until it is decided), a completion appears only when
    it has something new or just finished (``finish_reason`` and ``stop_reason`` on that last
    one), and the prompt fields are on the first output only (``prompt`` None and
    ``prompt_token_ids`` empty after it); ``RequestOutput.add`` merges deltas. Streams use it:
    a step costs what it generated, not a copy of the whole answer so far. ``FINAL_ONLY``: the
    engine posts nothing until the request finished (a non-streamed answer needs only its end,
    so no step copies text and token lists for it).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
"""The constraint kinds of ``StructuredOutputsParams`` (vLLM's names); exactly one is set."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output to a grammar, shaped like vLLM's ``StructuredOutputsParams``.

    Exactly one of ``json`` (a JSON schema, as a dict or its text), ``json_object`` (any JSON
    object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (a Lark grammar, as
    llguidance reads it) is set. Only the shape is checked here; the engine compiles the
    grammar (``engine.structured``) and refuses what does not compile, naming the problem.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None
    """JSON only: the whitespace allowed between tokens (llguidance's default: any, bounded)."""
    param: str = field(default="structured_outputs", compare=False)
    """The request field the constraint came from, named by errors (``response_format``, ...)."""

    def __post_init__(self) -> None:
        set_kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidParameterError(
                f"{self.param} must set exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                f"{', '.join(set_kinds) or 'none'}",
                param=self.param,
            )
        kind = set_kinds[0]
        value = getattr(self, kind)
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise InvalidParameterError(
                f"{self.param}: whitespace_pattern must be a string", param=self.param
            )
        if kind == "json" and not isinstance(value, str | dict):
            raise InvalidParameterError(f"{self.param}: json must be a JSON schema object", param=self.param)
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise InvalidParameterError(f"{self.param}: {kind} must be a non-empty string", param=self.param)
        if kind == "json_object" and value is not True:
            raise InvalidParameterError(f"{self.param}: json_object must be true", param=self.param)
        if kind == "choice" and (
            not isinstance(value, list | tuple)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise InvalidParameterError(
                f"{self.param}: choice must be a non-empty list of non-empty strings", param=self.param
            )

    @property
    def kind(self) -> str:
        """Which constraint is set: one of ``STRUCTURED_KINDS``."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """How to pick tokens for one request, and when to stop.

    Validation happens in ``__post_init__`` so a bad value fails before the request
    touches the engine (no block is ever allocated for it). Numbers are normalised
    (``temperature=1`` becomes ``1.0``, a numpy int becomes an ``int``).
    """

    n: int = 1
    """Number of completions to sample from the prompt (parallel sampling, copy-on-write)."""
    temperature: float = 1.0
    """0 (or anything below 1e-5) means greedy; higher flattens the distribution."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with cumulative probability >= top_p."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 (or 0) disables; above the vocabulary = all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's probability."""
    repetition_penalty: float = 1.0
    """HF-style: divide positive logits (multiply negative) of prompt and output tokens."""
    presence_penalty: float = 0.0
    """OpenAI-style: subtract once for every token already in the output."""
    frequency_penalty: float = 0.0
    """OpenAI-style: subtract per occurrence of a token in the output."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is batched."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the model's context length."""
    min_tokens: int = 0
    """Stop tokens and EOS are ignored until this many tokens were generated."""
    stop: list[str] | str | None = None
    """Stop strings; the text ends before the first match (excluded from the output)."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (kept in token_ids, not in the text)."""
    ignore_eos: bool = False
    """Keep generating after the EOS token (benchmarks)."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives per step."""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """Which outputs the engine posts for this request (``RequestOutputKind``)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, a regex, a choice or a grammar (guided decoding)."""
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.n = _int("n", self.n, 1)
        self.temperature = _float("temperature", self.temperature, ">= 0")
        if self.temperature < 0:
            raise InvalidParameterError(
                f"temperature must be >= 0 (0 = greedy), got {self.temperature}", param="temperature"
            )
        self.top_p = _float("top_p", self.top_p, "in (0, 1]")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameterError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        self.top_k = _int("top_k", self.top_k, -1, what=" (-1 or 0 = disabled)")
        self.min_p = _float("min_p", self.min_p, "in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameterError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty, "> 0")
        if self.repetition_penalty <= 0:
            raise InvalidParameterError(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}",
                param="repetition_penalty",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name), "in [-2, 2]")
            if not -2.0 <= value <= 2.0:
                raise InvalidParameterError(f"{name} must be in [-2, 2], got {value}", param=name)
            setattr(self, name, value)
        if self.seed is not None:
            self.seed = _int("seed", self.seed, SEED_MIN, SEED_MAX)
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, 1)
        self.min_tokens = _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameterError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, 0)
        self._stop_list = self._check_stop(self.stop)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list | tuple):
                raise InvalidParameterError(
                    f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}",
                    param="stop_token_ids",
                )
            self.stop_token_ids = [_int("stop_token_ids", t, 0) for t in self.stop_token_ids]
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidParameterError(
                f"output_kind must be a RequestOutputKind, got {self.output_kind!r}", param="output_kind"
            )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise InvalidParameterError(
                "structured_outputs must be StructuredOutputsParams", param="structured_outputs"
            )

    @staticmethod
    def _check_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stops: list[object] = [stop]
        elif isinstance(stop, list | tuple):
            stops = list(stop)
        else:
            raise InvalidParameterError(
                f"stop must be a string or a list of strings, got {stop!r}", param="stop"
            )
        for s in stops:
            if not isinstance(s, str) or not s:
                raise InvalidParameterError(
                    f"stop strings must be non-empty strings, got {s!r}", param="stop"
                )
        return [s for s in stops if isinstance(s, str)]

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
