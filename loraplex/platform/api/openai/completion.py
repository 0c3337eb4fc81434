"""A completions request (``/v1/completions``'s body) run to its response: the one pipeline of
the route and of the admin UI's playground."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from starlette.responses import Response

from loraplex.platform.api.openai.json_body import read_json
from loraplex.platform.api.openai.params import (
    check_prompt_chars,
    completion_params,
    guided_constraint,
    one_constraint,
)
from loraplex.platform.api.openai.protocol import CompletionRequest
from loraplex.platform.api.openai.responses import ResponseShape
from loraplex.platform.api.openai.serving import respond
from loraplex.platform.api.openai.tools import response_format_constraint
from loraplex.platform.api.state import AppState
from loraplex.platform.api.tenancy.gate import GatedCall


async def complete(request: Request, state: AppState, call: GatedCall) -> Response:
    """Read ``request``'s completions body, resolve its model for ``call`` and answer it, whole or
    streamed (a list of ``k`` prompts gives ``k * n`` choices, ``index = i * n + j``)."""
    body = await read_json(request, CompletionRequest)
    target = await call.resolve(body.model)
    prompts = body.prompts()
    beam = body.beam_search_params(
        body.max_tokens
    )  # None without use_beam_search; 400 for a field it cannot honour
    check_prompt_chars(sum(len(p) for p in prompts if isinstance(p, str)), state.limits, "prompt")
    constraint = one_constraint(response_format_constraint(body.response_format), guided_constraint(body))
    params = completion_params(body, state.limits, len(prompts), constraint)
    if constraint is not None:
        await state.engine.compile_grammar(constraint)  # off the loop; 400 naming the problem
    shape = ResponseShape(
        chat=False,
        request_id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=target.model,
        n=params.n,
        num_top_logprobs=body.logprobs,
        text_of=state.text_of,
        include_usage=body.include_usage(),
    )
    return await respond(request, state, call, shape, prompts, params, target, body.stream, beam)
