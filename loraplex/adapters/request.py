"""``LoRARequest``: which adapter a generation request wants, vLLM-compatible."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Names an adapter for a request, like ``vllm.lora.request.LoRARequest``.

    ``int_id`` is the adapter's id inside the engine (unique, >= 1); ``name`` is what
    clients put in ``model``; ``path`` points at a PEFT adapter folder, ``.zip`` or
    ``.tar.gz``. vLLM's attribute names (``lora_name``, ``lora_int_id``,
    ``lora_path``, ``adapter_id``) are available as read-only aliases, so code written
    against vLLM reads the same fields.
    """

    name: str
    int_id: int
    path: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"LoRARequest.name must be a non-empty string, got {self.name!r}")
        # bool is an int subclass; True as an id is always a bug.
        if isinstance(self.int_id, bool) or not isinstance(self.int_id, int) or self.int_id < 1:
            raise ValueError(f"LoRARequest.int_id must be an int >= 1, got {self.int_id!r}")
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"LoRARequest.path must be a non-empty string, got {self.path!r}")

    @property
    def lora_name(self) -> str:
        return self.name

    @property
    def lora_int_id(self) -> int:
        return self.int_id

    @property
    def lora_path(self) -> str:
        return self.path

    @property
    def adapter_id(self) -> int:
        return self.int_id
