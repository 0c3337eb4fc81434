"""The admin UI tests' fixtures: the tiny LoRA-enabled engine and a PEFT adapter (``gateway_testlib``)."""

from gateway_testlib import gateway_engine, peft_adapter_dir

__all__ = ["gateway_engine", "peft_adapter_dir"]
