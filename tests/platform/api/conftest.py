"""The gateway tests' fixtures (``gateway_testlib``): the tiny LoRA-enabled engine and a PEFT adapter."""

from gateway_testlib import gateway_engine, peft_adapter_dir

__all__ = ["gateway_engine", "peft_adapter_dir"]
