"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens for one request, and when to stop.

    Validation happens in ``__post_init__`` so a bad value fails before the request
    touches the engine (no block is ever allocated for it).
    """

    n: int = 1
    """Number of completions to sample from the prompt (parallel sampling, copy-on-write)."""
    temperature: float = 1.0
    """0 means greedy; higher flattens the distribution."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with cumulative probability >= top_p."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 (or 0) disables."""
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
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stop_list = stops

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
