"""``POST /v1/chat/completions``: the model's chat template, whole or streamed."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import jinja2
from fastapi import APIRouter, Request
from starlette.responses import Response

from loraplex.platform.api.deps import CallDep, StateDep
from loraplex.platform.api.errors import bad_request
from loraplex.platform.api.openai.json_body import documented_body, read_json
from loraplex.platform.api.openai.params import (
    chat_params,
    check_prompt_chars,
    guided_constraint,
    one_constraint,
)
from loraplex.platform.api.openai.protocol import ChatCompletionRequest
from loraplex.platform.api.openai.responses import ResponseShape
from loraplex.platform.api.openai.serving import respond
from loraplex.platform.api.openai.tool_parsers import template_renders_tools, tools_system_prompt
from loraplex.platform.api.openai.tools import (
    ToolPlan,
    plan_tools,
    refuse_conflicts,
    response_format_constraint,
)
from loraplex.platform.api.state import AppState
from loraplex.platform.engine.inputs import PromptType

router = APIRouter(tags=["chat"])


def _render(state: AppState, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """Template and tokenize (CPU work: runs in a worker thread, never on the event loop)."""
    tokenizer = state.tokenizer
    extra: dict[str, Any] = {}
    if tools is not None:
        extra["tools"] = [{"type": "function", "function": t} for t in tools]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    except jinja2.TemplateError as exc:  # the template refused the conversation (e.g. role order)
        raise bad_request(f"The chat template refused these messages: {exc}", "messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def _with_tools(
    messages: list[dict[str, Any]], plan: ToolPlan | None, template: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the ``tools`` for the template: a template that renders tools gets them;
    one that does not gets them described in the system message (Hermes format)."""
    if plan is None or not plan.render:
        return messages, None
    if template_renders_tools(template):
        return messages, plan.tools
    prompt = tools_system_prompt(plan.tools)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
        return [first, *messages[1:]], None
    return [{"role": "system", "content": prompt}, *messages], None


@router.post(
    "/v1/chat/completions", response_model=None, openapi_extra=documented_body(ChatCompletionRequest)
)
async def create_chat_completion(request: Request, state: StateDep, call: CallDep) -> Response:
    """OpenAI chat completions over the model's own chat template; structured outputs
    (``response_format``, vLLM's guided fields) and tool calling (``tools``, ``tool_choice``)."""
    # Cheap checks first: the message count before any message is validated or templated.
    body = await read_json(request, ChatCompletionRequest, {"messages": state.limits.max_chat_messages})
    target = await call.resolve(body.model)
    template = getattr(state.tokenizer, "chat_template", None)
    if not template:
        raise bad_request("This model has no chat template; use /v1/completions.", "messages")
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, str(template))
    response_format = response_format_constraint(body.response_format)
    refuse_conflicts(plan, response_format)
    constraint = one_constraint(plan.constraint() if plan else None, response_format, guided_constraint(body))
    messages, tools = _with_tools(body.text_messages(), plan, str(template))
    check_prompt_chars(sum(len(str(m["content"])) for m in messages), state.limits, "messages")
    params = chat_params(body, state.limits, constraint)
    beam = body.beam_search_params(params.max_tokens)  # None without use_beam_search
    if constraint is not None:
        await state.engine.compile_grammar(constraint)  # off the loop; 400 naming the problem

    async def render() -> list[PromptType]:  # run by the gate once the request is admitted
        return [await asyncio.to_thread(_render, state, messages, tools)]

    shape = ResponseShape(
        chat=True,
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=target.model,
        n=params.n,
        num_top_logprobs=params.logprobs,
        text_of=state.text_of,
        include_usage=body.include_usage(),
        tools=plan,
    )
    return await respond(request, state, call, shape, render, params, target, body.stream, beam)
