"""How a request refused for its adapter is told: to the client, in words that name no internal id,
path or file (a gateway's engine names carry its row id; store paths are the server's); to the
operator's log, the whole story."""

from __future__ import annotations

import logging

from loraplex.adapters import (
    AdapterError,
    AdapterNotFoundError,
    AdapterRemovedError,
    AdapterValidationError,
    LoRARequest,
)
from loraplex.platform.engine.errors import ErrorKind, RequestError
from loraplex.platform.engine.sequence import Sequence

logger = logging.getLogger(__name__)


def public_name(lora: LoRARequest) -> str:
    """How a client-facing message names ``lora``: its name without the version and row id a gateway
    appends to make engine names unique (``owner/name@version#id`` -> ``owner/name``)."""
    return lora.name.split("@", 1)[0]


def public_reason(exc: AdapterError) -> str:
    """Why an adapter cannot be served, in words that name no internal id, path or file: the
    validation rule that failed, or what happened to it. The full error goes to the server's log."""
    if isinstance(exc, AdapterValidationError):
        return f"its files failed the check {exc.reason!r}"
    if isinstance(exc, AdapterRemovedError):
        return "it was removed"
    if isinstance(exc, AdapterNotFoundError):
        return "it is not registered"
    return "it could not be loaded"


def refuse(seq: Sequence, exc: AdapterError, removed: bool = False) -> None:
    """Set the error ``seq``'s request ends with, its adapter failing with ``exc`` (``removed``:
    the adapter was removed at run time while the request waited), and log the whole story."""
    lora = seq.request.lora
    assert lora is not None
    if removed:
        message = f"adapter {public_name(lora)!r} was removed while this request waited"
    else:
        message = f"adapter {public_name(lora)!r} cannot be served: {public_reason(exc)}"
    seq.request.error = RequestError(ErrorKind.ADAPTER_UNAVAILABLE, message)
    # The whole story for the operator; the client's message names no id or path.
    request_id = seq.request.request_id
    logger.warning("request %s rejected: adapter %r (id %d): %s", request_id, lora.name, lora.int_id, exc)
