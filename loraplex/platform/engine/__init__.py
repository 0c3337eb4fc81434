"""The engine core: request state, scheduling, the step loop, sampling and the async facade.

| module | owns |
|---|---|
| ``config`` | ``EngineConfig`` (frozen, validated) and ``RuntimeInfo`` (derived at start-up) |
| ``sampling_params`` | ``SamplingParams``: per-request sampling and stop settings |
| ``sequence`` | ``Request`` and ``Sequence`` state |
| ``scheduler`` | continuous batching, chunked prefill, preemption; ``SchedulerOutput`` |
| ``forward_batch`` | ``ForwardBatch``: the one value a step passes down into the model |
| ``runner`` | builds the ``ForwardBatch`` from the scheduler's output and runs the forward |
| ``lora_runtime`` | adapter admission, pins and per-step LoRA metadata |
| ``sampler`` / ``detokenizer`` / ``outputs`` | next tokens, incremental text, ``RequestOutput`` |
| ``engine`` | ``LLMEngine``: add / abort / step |
| ``async_engine`` | ``AsyncEngine``: the engine in its own thread, streaming to asyncio callers |
| ``errors`` | the engine's typed errors, which the HTTP layer maps to status codes |
| ``host_memory`` | process-wide malloc tuning on CPU |
"""
