"""What ``LLM.generate`` returns; the names follow vLLM's ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
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
    """One of the ``n`` completions of a request: all of it so far, or with
    ``RequestOutputKind.DELTA`` only what is new since the request's last output."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: CompletionOutput) -> None:
        """Append ``delta``, the next ``RequestOutputKind.DELTA`` output of this completion, in
        place: its text, token ids and logprobs follow ours; its running totals and finish win."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason

    def copy(self) -> CompletionOutput:
        """A copy whose lists are its own (``add`` on it leaves this one as it is)."""
        logprobs = None if self.logprobs is None else list(self.logprobs)
        return replace(self, token_ids=list(self.token_ids), logprobs=logprobs)


@dataclass
class RequestOutput:
    """The state of one request: its prompt and every completion so far (with
    ``RequestOutputKind.DELTA``: the completions that changed, each with only what is new, and
    the prompt on the first output only: ``prompt`` None and ``prompt_token_ids`` empty after)."""

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

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge ``next_output``, a later output of the same request, into this one, in place
        (vLLM's ``RequestOutput.add``): with ``aggregate`` (``RequestOutputKind.DELTA``) each of its
        completions is appended to ours of the same index (``CompletionOutput.add``), else it
        replaces it; a completion we lack is added. The prompt fields stay ours (a delta carries
        them on the request's first output only); the finish state, cache and metrics are its."""
        mine = {c.index: i for i, c in enumerate(self.outputs)}
        added = False
        for completion in next_output.outputs:
            i = mine.get(completion.index)
            if i is None:
                # A copy: ours is extended in place by later deltas, and the caller may still
                # read ``next_output``.
                mine[completion.index] = len(self.outputs)
                self.outputs.append(completion.copy() if aggregate else completion)
                added = True
            elif aggregate:
                self.outputs[i].add(completion)
            else:
                self.outputs[i] = completion
        if added:
            self.outputs.sort(key=lambda c: c.index)
        if next_output.prompt_token_ids:  # (a delta after the first has none)
            self.prompt, self.prompt_token_ids = next_output.prompt, next_output.prompt_token_ids
        self.finished = self.finished or next_output.finished
        self.num_cached_tokens = next_output.num_cached_tokens
        self.metrics = {**self.metrics, **next_output.metrics}
        if next_output.error is not None:
            self.error = next_output.error

    def copy(self) -> RequestOutput:
        """A copy whose completions are its own (``add`` on it leaves this one as it is)."""
        return replace(self, outputs=[c.copy() for c in self.outputs], metrics=dict(self.metrics))
