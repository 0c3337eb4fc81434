"""From a request body to the engine's ``SamplingParams``, under the server's limits.

The HTTP layer checks what only it knows (its ``ServerLimits``, which field name the
client used, the OpenAI caps); ``SamplingParams`` and ``LLMEngine.add_request`` check
the rest (ranges, finiteness, the context and the scheduler's limits) and raise
``InvalidParameterError`` naming the field.
"""

from __future__ import annotations

from typing import Any

from loraplex.platform.api.errors import bad_request
from loraplex.platform.api.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from loraplex.platform.engine.sampling_params import STRUCTURED_KINDS, SamplingParams, StructuredOutputsParams
from loraplex.platform.settings import ServerLimits


def check_prompt_chars(num_chars: int, limits: ServerLimits, param: str) -> None:
    """Refuse prompt text over the limit before any tokenization is spent on it."""
    if num_chars > limits.max_prompt_chars:
        raise bad_request(
            f"The prompt has {num_chars} characters, over this server's limit of {limits.max_prompt_chars}.",
            param,
            code="context_length_exceeded",
        )


def _check_shared(body: SamplingFields, limits: ServerLimits, num_prompts: int) -> None:
    if body.n >= 1 and body.n * num_prompts > limits.max_n:
        what = f"n={body.n}" if num_prompts == 1 else f"n={body.n} for each of {num_prompts} prompts"
        raise bad_request(
            f"{what} asks for {body.n * num_prompts} completions, over this server's limit of {limits.max_n} "
            "per request.",
            "n",
        )
    stops = body.stop_list()
    if len(stops) > limits.max_stop_strings:
        raise bad_request(
            f"'stop' has {len(stops)} strings, over this server's limit of {limits.max_stop_strings}.", "stop"
        )
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_string_chars:
        raise bad_request(
            f"A stop string has {longest} characters, over this server's limit of "
            f"{limits.max_stop_string_chars}.",
            "stop",
        )
    num_stop_ids = len(body.stop_token_ids or [])
    if num_stop_ids > limits.max_stop_token_ids:
        raise bad_request(
            f"'stop_token_ids' has {num_stop_ids} entries, over this server's limit of "
            f"{limits.max_stop_token_ids}.",
            "stop_token_ids",
        )


def _check_max_tokens(name: str, value: int | None) -> None:
    # OpenAI answers 400 for 0; generating "up to the context" instead would surprise.
    if value is not None and value < 1:
        raise bad_request(f"'{name}' must be at least 1, got {value}.", name)


def _check_cap(name: str, value: int, cap: int) -> None:
    if not 0 <= value <= cap:
        raise bad_request(f"'{name}' must be between 0 and {cap}, got {value}.", name)


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def guided_constraint(body: SamplingFields) -> StructuredOutputsParams | None:
    """vLLM's ``structured_outputs`` object, or one of its older ``guided_*`` fields (at most one)."""
    given: list[tuple[str, Any]] = [(n, getattr(body, n)) for n in _GUIDED if getattr(body, n) is not None]
    if body.structured_outputs is not None:
        given.append(("structured_outputs", body.structured_outputs))
    if len(given) > 1:
        names = ", ".join(f"'{n}'" for n, _ in given)
        raise bad_request(f"Give at most one output constraint; got {names}.", given[1][0])
    if not given:
        return None
    name, value = given[0]
    if name != "structured_outputs":
        return StructuredOutputsParams(**{name.removeprefix("guided_"): value}, param=name)
    allowed = (*STRUCTURED_KINDS, "whitespace_pattern")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise bad_request(
            f"'structured_outputs' has unsupported fields {unknown}; it takes {', '.join(allowed)}.",
            "structured_outputs",
        )
    return StructuredOutputsParams(**value, param="structured_outputs")


def one_constraint(*constraints: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
    """The request's single output constraint; two (e.g. response_format and guided_json) are refused."""
    given = [c for c in constraints if c is not None]
    if len(given) > 1:
        raise bad_request(
            f"'{given[0].param}' and '{given[1].param}' both constrain the output; give one.", given[1].param
        )
    return given[0] if given else None


def _sampling_params(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    return SamplingParams(
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=body.stop_list() or None,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        structured_outputs=structured,
    )


def completion_params(
    body: CompletionRequest,
    limits: ServerLimits,
    num_prompts: int,
    structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """``SamplingParams`` of a completions request (its prompts already normalised)."""
    refused = body.unsupported_field()
    if refused is not None:
        raise refused
    _check_shared(body, limits, num_prompts)
    _check_max_tokens("max_tokens", body.max_tokens)
    if body.logprobs is not None:
        _check_cap("logprobs", body.logprobs, limits.max_completion_logprobs)
    return _sampling_params(body, body.max_tokens, body.logprobs, structured)


def chat_params(
    body: ChatCompletionRequest, limits: ServerLimits, structured: StructuredOutputsParams | None = None
) -> SamplingParams:
    """``SamplingParams`` of a chat request (``max_completion_tokens`` wins over ``max_tokens``)."""
    refused = body.unsupported_field()
    if refused is not None:
        raise refused
    _check_shared(body, limits, 1)
    _check_max_tokens("max_tokens", body.max_tokens)
    _check_max_tokens("max_completion_tokens", body.max_completion_tokens)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs: int | None = None
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
        _check_cap("top_logprobs", body.top_logprobs, limits.max_top_logprobs)
    if body.logprobs:
        logprobs = body.top_logprobs or 0
    return _sampling_params(body, max_tokens, logprobs, structured)
