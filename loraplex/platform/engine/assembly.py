"""Building an engine's parts from its ``EngineConfig``, in the order they depend on each other.

tokenizer and model -> the KV pool's size -> ``KVCache`` -> ``ModelRunner`` -> ``TieredKV``
(the pool's blocks and the host/disk tiers) -> with LoRA, the adapter runtime over the top
blocks of that same pool -> the scheduler, wired to both by hooks. ``LLMEngine`` keeps the
parts; what it adds is the request state and the step loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from loraplex.kernels.registry import (
    select_attention_backend,
    select_linear_backend,
    select_pointwise_backend,
)
from loraplex.platform.engine.config import EngineConfig, RuntimeInfo, parse_dtype
from loraplex.platform.engine.host_memory import tune_host_malloc
from loraplex.platform.engine.lora_runtime import LoRARuntime
from loraplex.platform.engine.preemption import PreemptionPolicy
from loraplex.platform.engine.runner import ModelRunner
from loraplex.platform.engine.scheduler import Scheduler, SchedulerLimits
from loraplex.platform.model.arch import ModelArch
from loraplex.platform.model.loader import load_hf_config, load_model
from loraplex.platform.model.packed_weights import resolve_quantization
from loraplex.platform.model.source import gguf_source, resolve_model_dir
from loraplex.storage.kv.kv_arena import KVPageArena
from loraplex.storage.kv.kv_cache import KVCache, kv_bytes_per_block, num_blocks_for_budget
from loraplex.storage.kv.tiers.tiered_kv import TieredKV

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """What ``assemble`` built: everything an ``LLMEngine`` runs on."""

    model_dir: Path
    quantization: str
    """The resolved weight storage (``none``, ``gguf``, ``gguf_a8``, ``int8``)."""
    tokenizer: PreTrainedTokenizerBase
    model: Any
    arch: ModelArch
    hf_config: Any
    info: RuntimeInfo
    runner: ModelRunner
    kv: TieredKV
    lora: LoRARuntime | None
    """The adapter runtime, None without ``enable_lora``."""
    preemption: PreemptionPolicy
    scheduler: Scheduler
    backends: str
    """The kernels chosen, for the start-up log line."""


def kv_fingerprint(
    model_config_json: str, dtype: torch.dtype, block_size: int, quantization: str = "none"
) -> bytes:
    """What a cached KV block is only valid for: the model, its weights' storage, the KV dtype
    and layout.

    The root of every prefix-cache key chain binds it, so blocks computed by another
    model or layout can never be found (the disk tier persists it with each block).
    """
    layout = f"kv-layout-v1|{dtype}|block_size={block_size}|[num_blocks, block_size, kv_heads, head_dim]"
    if quantization != "none":  # other weights' KV (unchanged for "none", so old disk tiers still match)
        # "-act16": gguf's projections quantize activations to int16 since quant_x16.c, so KV
        # written by the earlier fp32-activation kernels (or by gguf_a8) is other numbers.
        layout += f"|weights={quantization}" + ("-act16" if quantization == "gguf" else "")
    return hashlib.sha256(model_config_json.encode() + b"\0" + layout.encode()).digest()


def eos_token_ids(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence id and those of ``generation_config.json``."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return tuple(sorted(ids))


def assemble(config: EngineConfig) -> EngineParts:
    """Load the model and build the KV pool, its tiers, the adapter runtime and the scheduler."""
    from transformers import AutoTokenizer

    device = config.torch_device()
    dtype = parse_dtype(config.dtype, device)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model_dir = resolve_model_dir(config.model)
    gguf_path = gguf_source(config.model)
    quantization = resolve_quantization(config.quantization, gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    hf_config = load_hf_config(model_dir)
    arch = ModelArch.from_hf_config(hf_config)
    max_model_len = config.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's context of {arch.max_position_embeddings}"
        )
    if device.type == "cpu":
        tune_host_malloc()
    linear = select_linear_backend(config.linear_backend, device)
    pointwise = select_pointwise_backend(device)
    model, loaded_arch, loaded_hf_config = load_model(
        model_dir, dtype, device, max_model_len, linear, pointwise, quantization, gguf_path
    )
    per_block = kv_bytes_per_block(
        arch.num_layers, config.block_size, arch.num_kv_heads, arch.head_dim, dtype
    )
    num_blocks = config.num_kv_blocks or num_blocks_for_budget(
        per_block,
        device,
        config.kv_cache_memory,
        config.gpu_memory_utilization,
    )
    info = RuntimeInfo(
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        num_kv_blocks=num_blocks,
        kv_bytes_per_block=per_block,
        eos_token_ids=eos_token_ids(model_dir, tokenizer),
    )
    kv_cache = KVCache(
        arch.num_layers, num_blocks, config.block_size, arch.num_kv_heads, arch.head_dim, dtype, device
    )
    fingerprint = kv_fingerprint(hf_config.to_json_string(), dtype, config.block_size, quantization)
    runner = ModelRunner(
        model,
        kv_cache,
        select_attention_backend(config.attention_backend, device),
        device,
        enforce_eager=config.enforce_eager,
    )
    limits = SchedulerLimits(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        policy=config.scheduling_policy,
        watermark_blocks=max(1, num_blocks // 100) if num_blocks > 100 else 0,
    )
    # The device pool's blocks and the host/disk tiers below it, wired by TieredKV itself.
    kv = TieredKV.create(
        kv_cache,
        fingerprint,
        enable_prefix_caching=config.enable_prefix_caching,
        host_kv_cache_bytes=config.host_kv_cache_bytes,
        disk_kv_path=config.disk_kv_path,
        disk_kv_cache_bytes=config.disk_kv_cache_bytes,
        # Blocks every layer's window has passed go back to the pool while a sequence runs;
        # one global layer (Gemma 2/3, Qwen2's first max_window_layers) needs them all.
        sliding_window=loaded_arch.sliding_window if loaded_arch.all_layers_windowed else None,
    )
    lora: LoRARuntime | None = None
    if config.enable_lora:
        # Adapter pages borrow free blocks from the top of the same pool (KV first).
        arena = KVPageArena(
            kv_cache,
            kv.block_manager.pool,
            cap_blocks=config.lora_memory_bytes // per_block,
            reserve_blocks=limits.watermark_blocks,
        )
        lora = LoRARuntime(config, loaded_hf_config, device, dtype, arena)
    preemption = PreemptionPolicy(config.preemption_mode, per_block, can_swap=kv.can_swap)
    scheduler = Scheduler(
        limits,
        kv,
        lora.admit if lora else None,
        lora.release if lora else None,
        preemption,
        fork_hook=lora.on_fork if lora else None,
        lookahead_hook=lora.lookahead if lora else None,
        idle_wait_hook=lora.wait_for_a_read if lora else None,
        load_hook=lora.load if lora else None,
        memory_hook=lora.give_back_memory if lora else None,
    )
    backends = f"{runner.attn.name} attention, {linear.name} linear, {pointwise.name} pointwise"
    return EngineParts(
        model_dir=model_dir,
        quantization=quantization,
        tokenizer=tokenizer,
        model=model,
        arch=loaded_arch,
        hf_config=loaded_hf_config,
        info=info,
        runner=runner,
        kv=kv,
        lora=lora,
        preemption=preemption,
        scheduler=scheduler,
        backends=backends,
    )
