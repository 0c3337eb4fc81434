"""A minimal OpenAI-compatible HTTP server over the async engine.

``/v1/completions``, ``/v1/chat/completions`` (both with SSE streaming and
``stream_options.include_usage``), ``/v1/models``, ``/health``. Tenancy (API keys,
quotas) arrives with the gateway; this layer already speaks OpenAI's error body.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from loraplex.platform.async_engine import AsyncEngine
from loraplex.platform.outputs import RequestOutput
from loraplex.platform.protocol import ChatCompletionRequest, CompletionRequest, error_body


def _usage(out: RequestOutput) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def build_app(engine: AsyncEngine, served_model_name: str, loras: dict[str, Any] | None = None) -> FastAPI:
    """The FastAPI application serving ``engine`` under ``served_model_name``.

    ``loras`` maps model ids to ``LoRARequest``s: a request whose ``model`` names an
    adapter runs on it (vLLM's ``--lora-modules`` semantics).
    """
    adapters = dict(loras or {})
    app = FastAPI(title="loraplex", version="0.1.0")
    tokenizer = engine.engine.tokenizer
    max_len = engine.engine.info.max_model_len

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(f"{param}: {first.get('msg', 'invalid request')}", param=param), 400)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse(error_body(str(exc)), 400)

    def _check_model(model: str | None) -> Any:
        """The LoRARequest ``model`` names, None for the base model; LookupError otherwise."""
        if model in (None, served_model_name):
            return None
        if model in adapters:
            return adapters[model]
        raise LookupError(model)

    @app.exception_handler(LookupError)
    async def _unknown_model(_: Request, exc: LookupError) -> JSONResponse:
        return JSONResponse(
            error_body(f"The model '{exc.args[0]}' does not exist.", "NotFoundError", "model", 404), 404
        )

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        base = {"id": served_model_name, "object": "model", "owned_by": "loraplex", "max_model_len": max_len}
        data = [base] + [
            {"id": name, "object": "model", "owned_by": "loraplex", "parent": served_model_name}
            for name in sorted(adapters)
        ]
        return {"object": "list", "data": data}

    async def _collect(prompt: str | list[int], params: Any, lora: Any) -> RequestOutput:
        final: RequestOutput | None = None
        async for out in engine.generate(prompt, params, lora_request=lora):
            final = out
        assert final is not None
        return final

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> Any:
        lora = _check_model(body.model)
        if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int):
            raise ValueError("prompt: batched prompts are not supported; send one prompt per request")
        prompt: str | list[int] = body.prompt  # type: ignore[assignment]
        params = body.sampling_params(body.max_tokens, body.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            model = body.model or served_model_name
            return await _sse(
                engine, prompt, params, rid, created, model, "text_completion", include_usage, lora
            )
        out = await _collect(prompt, params, lora)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": body.model or served_model_name,
            "choices": [
                {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
                for c in out.outputs
            ],
            "usage": _usage(out),
        }

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest) -> Any:
        lora = _check_model(body.model)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        text = tokenizer.apply_chat_template(body.text_messages(), tokenize=False, add_generation_prompt=True)
        prompt = list(tokenizer.encode(text, add_special_tokens=False))
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = body.sampling_params(max_tokens, body.top_logprobs if body.logprobs else None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await _sse(
                engine,
                prompt,
                params,
                rid,
                created,
                body.model or served_model_name,
                "chat.completion.chunk",
                include_usage,
                lora,
            )
        out = await _collect(prompt, params, lora)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": body.model or served_model_name,
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason,
                }
                for c in out.outputs
            ],
            "usage": _usage(out),
        }

    return app


async def _sse(
    engine: AsyncEngine,
    prompt: str | list[int],
    params: Any,
    rid: str,
    created: int,
    model: str,
    obj: str,
    include_usage: bool,
    lora: Any = None,
) -> StreamingResponse:
    chat = obj == "chat.completion.chunk"
    stream = cast(
        AsyncGenerator[RequestOutput, None],
        engine.generate(prompt, params, request_id=rid, lora_request=lora),
    )
    # Pull the first output before answering, so a request the engine rejects gets
    # a 400 with OpenAI's error body instead of a broken 200 stream.
    first = await stream.__anext__()

    async def outputs() -> AsyncIterator[RequestOutput]:
        yield first
        async for out in stream:
            yield out

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in _chunks():
                yield chunk
        finally:
            # A client that disconnects lands here: closing the stream aborts the
            # request and frees its KV blocks.
            await stream.aclose()

    async def _chunks() -> AsyncIterator[str]:
        sent: dict[int, int] = {}
        last: RequestOutput | None = None
        async for out in outputs():
            last = out
            for c in out.outputs:
                start = sent.get(c.index, 0)
                # Hold back a possible stop-string prefix until the completion ends.
                hold = (
                    0 if c.finished() or not params.stop_strings else max(map(len, params.stop_strings)) - 1
                )
                end = max(start, len(c.text) - hold)
                delta = c.text[start:end]
                if not delta and not c.finished():
                    continue
                sent[c.index] = end
                choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason}
                if chat:
                    choice["delta"] = {"content": delta} if start else {"role": "assistant", "content": delta}
                else:
                    choice["text"] = delta
                chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
                yield f"data: {json.dumps(chunk)}\n\n"
        if include_usage and last is not None:
            usage = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(last),
            }
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
