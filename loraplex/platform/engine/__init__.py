"""The engine core: request state, scheduling, the step loop, sampling and the async facade.

| module | owns |
|---|---|
| ``config`` | ``EngineConfig`` (frozen, validated) and ``RuntimeInfo`` (derived at start-up) |
| ``sampling_params`` | ``SamplingParams``: per-request sampling and stop settings |
| ``sequence`` | ``Request`` and ``Sequence`` state |
| ``scheduler`` | ``Scheduler``: continuous batching, chunked prefill, preemption; ``AdmitDecision`` |
| ``scheduler_output`` | ``SchedulerOutput`` / ``ScheduledSeq``: one step's plan, as the runner reads it |
| ``policy`` | ``SchedulingPolicy`` (fcfs, priority, fair): admission order, preemption victim, accounting |
| ``deadlines`` | ``Deadlines``: which requests are past their ``request_timeout_s`` |
| ``tier_admission`` | what admission asks of the KV tiers: promotions, swapped tails |
| ``preemption`` | ``PreemptionPolicy``: swap or recompute a preempted sequence's partial tail |
| ``runner`` | builds the model's ``ForwardBatch`` from the scheduler's output and runs the forward |
| ``lora_runtime`` | ``LoRARuntime``: the adapter manager, its registry; facade over admission and passes |
| ``lora_admission`` | ``LoRAAdmission``: the scheduler's adapter hooks: pins, the drain rule, read-ahead |
| ``lora_passes`` | ``LoRAPasses``: a step's page passes per group, the LoRA hook and its prebound C sites |
| ``lora_refusals`` | what a request refused for its adapter is told (no id or path), and what is logged |
| ``sampler`` / ``detokenizer`` / ``outputs`` | next tokens, incremental text, ``RequestOutput`` |
| ``output_processor`` | after the forward: forks, sampling, stop checks, the step's ``RequestOutput``s |
| ``validation`` | the checks ``add_request`` runs on a request before it is queued |
| ``engine`` | ``LLMEngine``: add / abort / step |
| ``request_factory`` | ``RequestFactory``: a caller's request validated into a ``Request``; its sequences |
| ``request_book`` | ``RequestBook``: the unfinished requests and the one way each one ends |
| ``assembly`` | ``assemble``: the engine's parts built from its config, in dependency order |
| ``maintenance`` | ``MaintenanceQueue``: purges and resets run in bounded slices between steps |
| ``async_engine`` | ``AsyncEngine``: the engine in its own thread; the server's only door to it |
| ``limits`` | ``EngineLimits``: what a running engine accepts (built by the engine, read by the server) |
| ``inputs`` | ``PromptType``: a prompt as the engine takes it (text or token ids) |
| ``stats`` | ``EngineStats`` / ``TenantUsage``: value types of one snapshot per step (built by the engine) |
| ``engine_thread`` | ``EngineThread``: the one thread that touches the engine: its inbox, streams and jobs |
| ``commands`` | the engine thread's commands (add, abort, call, start a job): objects that apply themselves |
| ``request_stream`` | ``RequestStream``: one request's outputs handed from the engine thread to its reader |
| ``counters`` | ``TenantCounters`` / ``RejectionCounters``: counted by the engine, frozen per snapshot |
| ``errors`` | the engine's typed errors (the HTTP layer maps them to status codes); ``RejectionReason`` |
| ``host_memory`` | process-wide malloc tuning on CPU |
| ``kv_events`` | KV cache events for routers: vLLM's config, msgpack layout and ZeroMQ publisher |
| ``structured/`` | guided decoding: grammars compiled per constraint, per-sequence state, the masks |
| ``speculative`` | speculation's config and policy, n-gram (prompt-lookup) drafts, their verification |
| ``spec_policy`` | how many drafts each sequence gets: measured acceptance against measured step cost |
| ``draft_model`` | drafts from a smaller model on its own paged KV, rolled back with its sequence |
| ``beam_search`` | ``LLM.beam_search``: beams that fork block tables and share blocks copy-on-write |
| ``beam_rule`` | the ranking rule (HF's) of a search step, shared by the offline and the server's search |
"""
