"""``POST /v1/chat/completions``: the model's chat template, whole or streamed."""

from __future__ import annotations

import asyncio
import time
import uuid

import jinja2
from fastapi import APIRouter, Request
from starlette.responses import Response

from loraplex.platform.api.deps import CallDep, StateDep
from loraplex.platform.api.errors import bad_request
from loraplex.platform.api.openai.json_body import documented_body, read_json
from loraplex.platform.api.openai.params import chat_params, check_prompt_chars
from loraplex.platform.api.openai.protocol import ChatCompletionRequest, Prompt
from loraplex.platform.api.openai.responses import ResponseShape
from loraplex.platform.api.openai.serving import respond
from loraplex.platform.api.state import AppState

router = APIRouter(tags=["chat"])


def _render(state: AppState, messages: list[dict[str, str]]) -> list[int]:
    """Template and tokenize (CPU work: runs in a worker thread, never on the event loop)."""
    tokenizer = state.tokenizer
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except jinja2.TemplateError as exc:  # the template refused the conversation (e.g. role order)
        raise bad_request(f"The chat template refused these messages: {exc}", "messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


@router.post(
    "/v1/chat/completions", response_model=None, openapi_extra=documented_body(ChatCompletionRequest)
)
async def create_chat_completion(request: Request, state: StateDep, call: CallDep) -> Response:
    """OpenAI chat completions over the model's own chat template."""
    # Cheap checks first: the message count before any message is validated or templated.
    body = await read_json(request, ChatCompletionRequest, {"messages": state.limits.max_chat_messages})
    target = await call.resolve(body.model)
    if not getattr(state.tokenizer, "chat_template", None):
        raise bad_request("This model has no chat template; use /v1/completions.", "messages")
    messages = body.text_messages()
    check_prompt_chars(sum(len(m["content"]) for m in messages), state.limits, "messages")
    params = chat_params(body, state.limits)

    async def render() -> list[Prompt]:  # run by the gate once the request is admitted
        return [await asyncio.to_thread(_render, state, messages)]

    shape = ResponseShape(
        chat=True,
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=target.model,
        n=params.n,
        num_top_logprobs=params.logprobs,
        text_of=state.text_of,
        include_usage=body.include_usage(),
    )
    return await respond(request, state, call, shape, render, params, target, body.stream)
