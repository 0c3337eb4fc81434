"""Compute kernels of the engine: contracts, a registry, and three implementations.

- ``contracts``: ``AttentionBackend``, ``LoRABackend``, ``LinearBackend`` and the backend
  names users choose from (``AttentionBackendName``, ``ATTENTION_BACKEND_NAMES``, ...);
- ``registry``: ``select_attention_backend`` / ``select_lora_backend`` /
  ``select_linear_backend``, resolving "auto" by device;
- ``metadata``: the flat-batch ``AttentionMetadata`` / ``LoRAMetadata`` and ``PAD_BLOCK_ID``;
- ``lora_layout``: how the slot buffers store adapter weights for a backend;
- ``rotary_layout``: the order q/k rows are kept in so whole-head rotary kernels serve a partial
  rotary (``partial_rotary_factor``, Phi-4-mini);
- ``portable/``: pure PyTorch, used wherever no C or Triton kernel applies (the "torch" backend);
- ``cpu/``: C kernels compiled for the host (decode attention, LoRA, dense projections);
- ``triton/``: the CUDA kernels (paged decode, extend attention, cache ops, BGMV/SGMV LoRA).

Implementations import ``contracts``, ``metadata`` and ``lora_layout`` only; the registry
imports implementations, never the other way round. See docs/kernels.md.
"""
