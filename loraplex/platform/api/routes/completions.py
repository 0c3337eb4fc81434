"""``POST /v1/completions``: one prompt or a list of them, whole or streamed."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from loraplex.platform.api.deps import CallDep, StateDep
from loraplex.platform.api.openai.completion import complete
from loraplex.platform.api.openai.json_body import documented_body
from loraplex.platform.api.openai.protocol import CompletionRequest

router = APIRouter(tags=["completions"])


@router.post("/v1/completions", response_model=None, openapi_extra=documented_body(CompletionRequest))
async def create_completion(request: Request, state: StateDep, call: CallDep) -> Response:
    """OpenAI completions; a list of ``k`` prompts gives ``k * n`` choices (``index = i * n + j``)."""
    return await complete(request, state, call)
