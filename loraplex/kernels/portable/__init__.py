"""The portable backend: pure PyTorch, used wherever no C or Triton kernel applies.

It runs on any device torch runs on, is the engine's CPU path where the C kernels do
not apply (prefill/extend attention, half-precision LoRA), and is the baseline the
Triton kernels are checked against. Users select it as ``"torch"``.

- ``attention``: ``PortableAttentionBackend``;
- ``paged_decode`` / ``extend_attention``: the attention math it runs, block-table gathers;
- ``cache_ops``: KV writes by slot and copy-on-write block copies;
- ``lora``: ``PortableLoRABackend`` (tokens grouped by adapter, bucketed batched matmuls);
- ``linear``: ``PortableLinearBackend`` (``F.linear``).
"""
