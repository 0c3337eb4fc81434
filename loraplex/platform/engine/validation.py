"""Validation of a request against the model and the engine's limits, before it is queued.

Everything a request carries is checked here, so no step can later fail because of one
request's parameters: bad values raise ``InvalidParameterError`` naming the parameter,
a request that could never be admitted ``RequestTooLargeError`` (vLLM's wording for
context overflows). ``SamplingParams`` checks its own types and ranges when built.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from loraplex.platform.engine.errors import InvalidParameterError, RequestTooLargeError
from loraplex.platform.engine.limits import EngineLimits
from loraplex.platform.engine.sampling_params import SamplingParams
from loraplex.storage.kv.block_manager import AllocStatus, KVBlockManager


def prompt_token_ids(
    prompt: str | list[int], tokenize: Callable[[str], list[int]], vocab_size: int
) -> tuple[str | None, list[int]]:
    """The prompt's text (None for token input) and its token ids, validated."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidParameterError("prompt must not be empty", param="prompt")
        token_ids = tokenize(prompt)
        text: str | None = prompt
    elif isinstance(prompt, list | tuple):
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise InvalidParameterError("prompt token ids must be integers", param="prompt")
        token_ids, text = list(prompt), None
    else:
        raise InvalidParameterError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", param="prompt"
        )
    if not token_ids:
        raise InvalidParameterError("prompt must not be empty (it has no tokens)", param="prompt")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidParameterError(
            f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}", param="prompt"
        )
    return text, token_ids


def check_request_limits(
    num_prompt_tokens: int, params: SamplingParams, limits: EngineLimits, kv: KVBlockManager
) -> None:
    """Refuse what the model, the pool or the scheduler could never serve."""
    max_len = limits.max_model_len
    if num_prompt_tokens >= max_len:
        raise RequestTooLargeError(
            f"This model's maximum context length is {max_len} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room to generate.",
            param="prompt",
        )
    if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > max_len:
        raise RequestTooLargeError(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{num_prompt_tokens + params.max_tokens} tokens ({num_prompt_tokens} in the prompt, "
            f"{params.max_tokens} in the completion). Please reduce the length of the prompt or "
            "max_tokens.",
            param="max_tokens",
        )
    if params.n > limits.max_num_seqs:
        # All n completions run side by side; more than max_num_seqs could never be admitted.
        raise RequestTooLargeError(
            f"n={params.n} is more than this server runs at once (max_num_seqs={limits.max_num_seqs})",
            param="n",
        )
    longest = num_prompt_tokens + (params.max_tokens if params.max_tokens is not None else 1)
    if kv.can_allocate(-1, min(longest, max_len)) is AllocStatus.NEVER:
        raise RequestTooLargeError(
            f"a sequence of {longest} tokens needs more KV blocks than the whole pool "
            f"({kv.num_blocks} blocks of {kv.block_size}); "
            "shorten the request or raise kv_cache_memory",
            param="max_tokens" if params.max_tokens is not None else "prompt",
        )
    if params.logprobs is not None and params.logprobs > limits.max_logprobs:
        raise InvalidParameterError(
            f"logprobs={params.logprobs} is more than the limit of {limits.max_logprobs} (max_logprobs)",
            param="logprobs",
        )
    vocab = limits.vocab_size
    bad = [t for t in params.stop_token_ids or () if not 0 <= t < vocab]
    if bad:
        raise InvalidParameterError(
            f"stop_token_ids out of range [0, {vocab}): {bad[:5]}", param="stop_token_ids"
        )


MAX_TENANT_WEIGHT = 1000.0
"""Largest fair-share weight: far beyond any useful ratio, and finite counters stay exact."""


def check_scheduling_params(tenant_weight: float, timeout_s: float | None) -> None:
    """A tenant weight in (0, ``MAX_TENANT_WEIGHT``] and a deadline > 0 s (or None)."""
    if (
        isinstance(tenant_weight, bool)
        or not isinstance(tenant_weight, int | float)
        or not 0 < tenant_weight <= MAX_TENANT_WEIGHT
    ):
        raise InvalidParameterError(
            f"tenant_weight must be a number in (0, {MAX_TENANT_WEIGHT:g}], got {tenant_weight!r}",
            param="tenant_weight",
        )
    if timeout_s is not None and (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        raise InvalidParameterError(f"timeout_s must be > 0 seconds, got {timeout_s!r}", param="timeout_s")
