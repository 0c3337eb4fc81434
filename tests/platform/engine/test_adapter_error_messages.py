"""Issue 43 (6): what a client is told when its adapter cannot be served names no internal id
(the engine's adapter id, the gateway's row id) and no server path; the log keeps them."""

from __future__ import annotations

import pytest

from loraplex.adapters import (
    AdapterError,
    AdapterNotFoundError,
    AdapterRemovedError,
    AdapterValidationError,
    LoRARequest,
)
from loraplex.platform.engine.lora_refusals import public_name, public_reason

GATEWAY_NAME = "acme/fr@0123456789ab#1734"
"""How the gateway names an adapter version in the engine: owner/name@version#row-id."""
SECRET_PATH = "/var/lib/loraplex/store/01/0123456789abcdef/adapter_model.safetensors"


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (AdapterValidationError("changed_on_disk", f"{SECRET_PATH} differs"), "changed_on_disk"),
        (AdapterRemovedError("adapter 1734 was removed"), "it was removed"),
        (AdapterNotFoundError("no adapter with id 1734"), "it is not registered"),
        (AdapterError(f"read {SECRET_PATH}: I/O error"), "it could not be loaded"),
    ],
)
def test_client_messages_name_no_internal_id_or_path(error: AdapterError, expected: str) -> None:
    lora = LoRARequest(GATEWAY_NAME, 42, SECRET_PATH)
    message = f"adapter {public_name(lora)!r} cannot be served: {public_reason(error)}"
    assert expected in message
    assert public_name(lora) == "acme/fr"
    for secret in ("1734", "42", "#", "/var/lib", "0123456789ab"):
        assert secret not in message, (secret, message)


def test_a_plain_name_is_kept_whole() -> None:
    assert public_name(LoRARequest("sql-lora", 1, "/x")) == "sql-lora"
