"""What ``LLM.generate`` returns; the names follow vLLM's ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from loraplex.platform.engine.errors import RequestError


class Logprob(NamedTuple):
    """Log-probability of one token (and its rank in the model's distribution).

    A tuple of atoms, not a dataclass: the garbage collector stops tracking such a tuple (and a
    dict holding only them) after its first pass, and a whole answer with ``top_logprobs=20`` holds
    67,000 of them. Tracked, they filled the collector's oldest generation while an answer was
    built, and each full collection then held the GIL for 100-150 ms, stalling every other
    request (tests/platform/api/test_hostile_soak.py)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and every completion so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    lora_name: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: RequestError | None = None
    """Set when the engine ended the request itself: a typed reason (``kind``) and a message."""
