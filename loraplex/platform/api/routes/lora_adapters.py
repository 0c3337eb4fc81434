"""vLLM's runtime adapter endpoints, for the operator: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (``Authorization: Bearer <admin token>``; a tenant's key is
refused). Bodies and answers are vLLM's::

    {"lora_name": "style", "lora_path": "/srv/adapters/style", "load_inplace": false}
    200 text  Success: LoRA adapter 'style' added successfully.
    {"lora_name": "style"}            (or {"lora_int_id": 12})
    200 text  Success: LoRA adapter 'style' removed successfully.

Refusals carry vLLM's ``type`` (``InvalidUserInput``, ``BadRequestError``, ``NotFoundError``) and
the status as ``code``. What is loaded is a public adapter of the operator's tenant, served on
every replica under its bare name (``catalog.runtime_loras``); mounted with tenants only.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict
from starlette.responses import PlainTextResponse

from loraplex.platform.api.catalog.runtime_loras import LoRALoadError
from loraplex.platform.api.deps import GatewayDep, require_admin
from loraplex.platform.api.errors import APIError

router = APIRouter(tags=["lora adapters"], dependencies=[Depends(require_admin)])


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's ``LoadLoRAAdapterRequest``."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False
    """Load a new version over an adapter already loaded under ``lora_name``."""


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's ``UnloadLoRAAdapterRequest``."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = ""
    lora_int_id: int | None = None


def _refusal(exc: LoRALoadError) -> APIError:
    return APIError(exc.status, exc.message, param=exc.param, code=exc.status, err_type=exc.err_type)


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, gateway: GatewayDep) -> PlainTextResponse:
    """Load an adapter from the store or a folder under ``lora_load_root`` as ``lora_name``."""
    try:
        await gateway.runtime_loras.load(body.lora_name, body.lora_path, body.load_inplace)
    except LoRALoadError as exc:
        raise _refusal(exc) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, gateway: GatewayDep) -> PlainTextResponse:
    """Remove an adapter the operator loaded (running requests finish on it)."""
    try:
        refs = await gateway.runtime_loras.unload(body.lora_name or None, body.lora_int_id)
    except LoRALoadError as exc:
        raise _refusal(exc) from None
    return PlainTextResponse(f"Success: LoRA adapter '{refs[0].name}' removed successfully.")
