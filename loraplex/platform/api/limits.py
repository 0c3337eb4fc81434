"""What one HTTP request may ask for: ``ServerLimits``, frozen, typed, validated when built.

Every field is a server setting (``loraplex serve --<field-name-with-dashes>``). The
defaults are meant to be kept by a public deployment: they bound the work a single
request can make the server do before the engine sees it (reading, parsing and
tokenizing the body) and the size of what it asks the engine for. Limits the engine
derives from its own configuration (context length, ``max_num_seqs``, the KV pool) are
checked by the engine, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

_ZERO_ALLOWED = ("max_completion_logprobs", "max_top_logprobs", "graceful_shutdown_s")
"""A logprobs cap of 0 still returns the sampled token's own logprob; 0 s means no grace."""


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits of the OpenAI-compatible server (HTTP 413 / 400 when exceeded)."""

    max_request_body_bytes: int = 8 * 1024 * 1024
    """Largest request body in bytes; larger bodies get 413 before they are read in full."""
    max_prompt_chars: int = 1_000_000
    """Most characters of prompt text per request (all prompts, or all chat messages),
    checked before tokenization; token-id prompts are bounded by the context length."""
    max_stop_strings: int = 16
    """Most entries in stop."""
    max_stop_string_chars: int = 256
    """Longest single stop string, in characters."""
    max_stop_token_ids: int = 64
    """Most entries in stop_token_ids."""
    max_n: int = 16
    """Most completions per request: n times the number of prompts."""
    max_completion_logprobs: int = 5
    """Largest logprobs on /v1/completions (OpenAI's cap is 5)."""
    max_top_logprobs: int = 20
    """Largest top_logprobs on /v1/chat/completions (OpenAI's cap is 20)."""
    graceful_shutdown_s: int = 10
    """On SIGTERM/SIGINT, how long open requests may run before they are cancelled."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            # A logprobs cap of 0 still allows the sampled token's own logprob.
            lowest = (
                0 if f.name in ("max_completion_logprobs", "max_top_logprobs", "graceful_shutdown_s") else 1
            )
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise ValueError(f"{f.name} must be an integer >= {lowest}, got {value!r}")
        if self.max_request_body_bytes < 1024:
            raise ValueError(
                "max_request_body_bytes must be >= 1024 (a minimal request), "
                f"got {self.max_request_body_bytes}"
            )
