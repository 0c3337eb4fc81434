"""Beam search for the server (vLLM's ``use_beam_search``), beside every other request.

The offline search (``LLM.beam_search``) drives an idle engine step by step; a server's engine is
never idle. So, as vLLM's server does, the search runs here, above the engine: every search step
submits one request per running beam for one token with the top ``candidates_per_step``
logprobs (greedy, EOS allowed), and ranks what comes back with ``hf_search_step``, the rule the
offline search uses, so both return the same beams. A beam's request is its prompt plus what
it generated: the prefix cache serves the shared part (every full block), so a step computes
about one block per beam. The requests run as the caller's tenant, under its fair share, the
server's queue limit and deadline, like any other; the client leaving aborts them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.adapters import LoRARequest
from loraplex.platform.api.errors import bad_request
from loraplex.platform.api.openai.submission import abort_all, collect, submit
from loraplex.platform.api.state import AppState
from loraplex.platform.engine.beam_rule import (
    BeamSearchParams,
    BeamSearchSequence,
    HypothesisBeam,
    candidates_per_step,
    hf_search_step,
)
from loraplex.platform.engine.inputs import PromptType
from loraplex.platform.engine.outputs import CompletionOutput, RequestOutput
from loraplex.platform.engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class BeamProgress:
    """Each prompt's running beams as a (partial) ``RequestOutput``, updated after every search
    step: what a search that ends early (the client left, a step failed) has generated, so its
    usage is counted like an aborted plain request's (the prompt and the tokens so far)."""

    outputs: dict[int, RequestOutput] = field(default_factory=dict)

    def so_far(self) -> list[RequestOutput]:
        """The prompts' outputs in prompt order (those that ran a step)."""
        return [self.outputs[i] for i in sorted(self.outputs)]


@dataclass
class _Search:
    """One prompt's finished hypotheses, and whether a running beam can still beat them."""

    finished: list[BeamSearchSequence] = field(default_factory=list)
    improvable: bool = True


def check_beam_width(state: AppState, params: BeamSearchParams) -> None:
    """Refuse (400 naming ``n``) a width whose search steps would ask for more logprobs per beam
    than the server's ``max_logprobs``, before the request is admitted."""
    num_eos = 0 if params.ignore_eos else len(state.engine.limits.eos_token_ids)
    need = candidates_per_step(params.beam_width, num_eos)
    cap = state.engine.limits.max_logprobs
    if need > cap:
        widest = max(w for w in range(1, params.beam_width + 1) if candidates_per_step(w, num_eos) <= cap)
        raise bad_request(
            f"use_beam_search with n={params.beam_width} ranks {need} candidates per beam, over this "
            f"server's max_logprobs of {cap}; use n <= {widest}.",
            "n",
        )


async def beam_search(
    state: AppState,
    request_id: str,
    prompts: list[PromptType],
    params: BeamSearchParams,
    lora: LoRARequest | None,
    tenant_id: str | None,
    tenant_weight: float,
    progress: BeamProgress | None = None,
) -> list[RequestOutput]:
    """Search every prompt (concurrently); one finished ``RequestOutput`` per prompt whose
    completions are its best ``beam_width`` beams, best first. ``progress`` follows the running
    beams, for the usage of a search that does not finish."""
    progress = progress if progress is not None else BeamProgress()
    searches = [
        _search_one(state, f"{request_id}-{i}", p, params, lora, tenant_id, tenant_weight, progress, i)
        for i, p in enumerate(prompts)
    ]
    return list(await asyncio.gather(*searches))


async def _search_one(
    state: AppState,
    request_id: str,
    prompt: PromptType,
    params: BeamSearchParams,
    lora: LoRARequest | None,
    tenant_id: str | None,
    tenant_weight: float,
    progress: BeamProgress,
    index: int,
) -> RequestOutput:
    engine = state.engine
    prompt_ids = await engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    eos = () if params.ignore_eos else tuple(engine.limits.eos_token_ids)
    keep = candidates_per_step(params.beam_width, len(eos))
    # One token, greedy, with the top ``keep`` logprobs of the raw distribution; EOS may come
    # out (it ranks like any token: the rule decides that the beam ends).
    step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=keep, ignore_eos=True)
    step_params.output_kind = RequestOutputKind.FINAL_ONLY
    search = _Search()
    beams = [HypothesisBeam(prompt_ids, [], 0)]
    cums = [0.0]  # each running beam's score: the sum of its tokens' logprobs
    num_cached = 0
    for step in range(params.max_tokens):
        rows = await asyncio.gather(
            *(
                _next_logprobs(
                    state,
                    f"{request_id}-s{step}-b{b}",
                    beam.tokens,
                    step_params,
                    lora,
                    tenant_id,
                    tenant_weight,
                )
                for b, beam in enumerate(beams)
            )
        )
        if step == 0:  # the prompt's tokens the cache served, as a plain request reports them
            num_cached = rows[0][1]
        # Each beam's top ``keep`` hold the best ``keep`` over all beams; ties in beam, then token order.
        candidates = [(cums[b] + lp, b, tok) for b, (row, _) in enumerate(rows) for tok, lp in row.items()]
        scored = sorted(candidates, key=lambda c: (-c[0], c[1], c[2]))[:keep]
        chosen = hf_search_step(
            search, scored, beams, _lookup(rows), params, eos, engine.limits.max_model_len
        )
        if chosen is None:
            break
        beams = [
            HypothesisBeam(
                [*beams[b].tokens, tok], [*beams[b].logprobs, rows[b][0][tok]], beams[b].num_generated + 1
            )
            for _, b, tok, _ in chosen
        ]
        cums = [score for score, _, _, _ in chosen]
        progress.outputs[index] = _running(request_id, prompt, prompt_ids, beams, cums, num_cached)
    return _output(state, request_id, prompt, prompt_ids, search.finished, eos, num_cached)


async def _next_logprobs(
    state: AppState,
    request_id: str,
    tokens: list[int],
    params: SamplingParams,
    lora: LoRARequest | None,
    tenant_id: str | None,
    tenant_weight: float,
) -> tuple[dict[int, float], int]:
    """The top logprobs of the token after ``tokens`` (token id -> logprob), and how many of
    ``tokens`` the prefix cache served."""
    streams = await submit(state, request_id, [tokens], params, lora, tenant_id, tenant_weight)
    try:
        (final,) = await collect(streams)
    finally:
        abort_all(streams)  # a no-op once finished; cancelled (the client left): stops it
    (completion,) = final.outputs
    if not completion.logprobs:
        raise RuntimeError(f"beam search step {request_id} came back without its logprobs")
    return {tok: lp.logprob for tok, lp in completion.logprobs[0].items()}, final.num_cached_tokens


def _running(
    request_id: str,
    prompt: PromptType,
    prompt_ids: list[int],
    beams: list[HypothesisBeam],
    cums: list[float],
    num_cached: int,
) -> RequestOutput:
    """The running beams as an unfinished request's output (token ids only: it is for usage)."""
    completions = [
        CompletionOutput(index=b, text="", token_ids=beam.tokens[len(prompt_ids) :], cumulative_logprob=cum)
        for b, (beam, cum) in enumerate(zip(beams, cums, strict=True))
    ]
    return _request_output(request_id, prompt, prompt_ids, completions, False, num_cached)


def _lookup(rows: list[tuple[dict[int, float], int]]) -> Callable[[int, int], float]:
    """Beam ``b``'s logprob of ``tok`` in this step's ``rows``."""
    return lambda b, tok: rows[b][0][tok]


def _output(
    state: AppState,
    request_id: str,
    prompt: PromptType,
    prompt_ids: list[int],
    finished: list[BeamSearchSequence],
    eos: tuple[int, ...],
    num_cached: int,
) -> RequestOutput:
    """The search's best beams as one finished request's completions (``n`` = the beam width)."""
    tokenizer = state.engine.tokenizer
    completions = []
    for index, beam in enumerate(finished):
        generated = beam.tokens[len(prompt_ids) :]
        shown = (
            generated[:-1]
            if beam.finish_reason == "stop" and generated and generated[-1] in eos
            else generated
        )
        completions.append(
            CompletionOutput(
                index=index,
                text=str(tokenizer.decode(shown, skip_special_tokens=True)),
                token_ids=generated,
                cumulative_logprob=beam.cum_logprob,
                finish_reason=beam.finish_reason,
                stop_reason=generated[-1] if beam.finish_reason == "stop" and generated else None,
            )
        )
    return _request_output(request_id, prompt, prompt_ids, completions, True, num_cached)


def _request_output(
    request_id: str,
    prompt: PromptType,
    prompt_ids: list[int],
    completions: list[CompletionOutput],
    finished: bool,
    num_cached: int,
) -> RequestOutput:
    """One prompt's search as a request's output (the text prompt shown only when it was text)."""
    return RequestOutput(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=prompt_ids,
        outputs=completions,
        finished=finished,
        num_cached_tokens=num_cached,
    )
