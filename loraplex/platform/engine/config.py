"""Engine configuration: frozen, typed, validated when built.

What is derived at start-up (the number of KV blocks, the model's context length)
lives in ``RuntimeInfo``, never written back into the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from loraplex.kernels.contracts import AttentionBackendName, LinearBackendName, LoRABackendName
from loraplex.platform.engine.kv_events.config import KVEventsConfig
from loraplex.platform.engine.policy import POLICY_NAMES, PolicyName
from loraplex.platform.engine.preemption import PREEMPTION_MODES, PreemptionMode
from loraplex.platform.engine.speculative import SpeculativeConfig

DEFAULT_LORA_MEMORY = 1 << 30
"""``lora_memory`` when unset: adapter pages may hold up to 1 GiB of the device pool
(docs/adapters.md works out how many adapters of which rank that holds)."""

DEFAULT_CPU_LORA_MEMORY = 2 << 30
"""``cpu_lora_memory`` when unset: 2 GiB of host memory for validated adapters (a cap, not a
reservation: only adapters in use fill it)."""

DType = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["auto", "none", "gguf", "gguf_a8", "int8"]
QUANTIZATIONS: tuple[Quantization, ...] = get_args(Quantization)
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Map a dtype name to torch; ``auto`` is float32 on CPU and bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start. Field names follow vLLM's engine args."""

    model: str | None = None
    """Local HF directory or .gguf file; None = the bundled SmolLM2-135M-Instruct."""
    dtype: DType = "auto"
    """float32 / bfloat16 / float16; auto = float32 on CPU, bfloat16 on CUDA."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto (cuda when available)."""
    quantization: Quantization = "auto"
    """How the base model's projections are stored: gguf keeps a GGUF file's own blocks (Q8_0,
    Q4_0, Q4_1, Q4_K, Q6_K, F16, BF16) and computes from them; int8 quantizes any float
    checkpoint per channel at load; none de-quantises to dtype (the HF-exact path); auto = gguf
    for a GGUF model, else none. gguf_a8 is gguf with llama.cpp's int8 activations at decode
    steps (faster on CPU; greedy tokens may differ from HF's at ordinary gaps: gguf's int16
    activations keep them)."""
    block_size: int = 16
    """Tokens per KV block."""
    max_num_seqs: int = 128
    """Most sequences in one step (running decodes plus prefill chunks)."""
    max_num_batched_tokens: int = 2048
    """Per-step token budget: decodes cost 1, prefill chunks take what is left."""
    max_model_len: int | None = None
    """Longest prompt + output; None = the model's max_position_embeddings."""
    kv_cache_memory: int | None = None
    """Bytes of the device pool on CPU (default 2 GiB, capped at a quarter of free RAM): KV
    blocks, and with LoRA the adapter pages, which borrow free blocks (up to ``lora_memory``)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory the engine may use on CUDA (weights + the pool of KV blocks
    and adapter pages)."""
    num_kv_blocks: int | None = None
    """Override the block count outright (tests and benchmarks)."""
    seed: int = 0
    """Seed of the engine's default generator (requests without their own seed)."""
    attention_backend: AttentionBackendName = "auto"
    """Attention kernels: triton on CUDA; on CPU the C decode kernel ("cpu") when a C
    compiler is present, else pure torch; force one here."""
    scheduling_policy: PolicyName = "fair"
    """Order of admission and preemption (engine/policy.py): fair (fair share across tenants by
    weighted virtual token counters, FCFS inside a tenant), fair_priority (priority inside a
    tenant), fcfs, or priority (lower value first, then arrival). Requests without a tenant share
    one, so fair orders them exactly like fcfs."""
    enable_lora: bool = False
    """Serve LoRA adapters (requests may name one)."""
    max_loras: int | None = None
    """Optional cap on adapters resident in accelerator memory at once (vLLM's name). None:
    as many as ``lora_memory`` holds (adapter pages are rank-granular, so that is memory-bound)."""
    max_cpu_loras: int | None = None
    """Most adapters kept loaded in host memory (LRU, vLLM's name); default max(2 * max_loras, 8)
    when ``max_loras`` is set, else no count cap (``cpu_lora_memory`` bounds the host LRU)."""
    cpu_lora_memory: int | None = None
    """Bytes of host memory for the LRU of validated adapters (default 2 GiB: ~1,100 rank-8 q/v
    adapters of SmolLM2); misses re-read the store."""
    max_lora_rank: int = 64
    """Largest adapter rank accepted (validation: adapters take pages for their own rank)."""
    lora_page_rank: int = 8
    """Rank rows per adapter page: an adapter of rank r takes ceil(r / lora_page_rank) pages of
    each projection group it targets."""
    lora_memory: int | None = None
    """Most bytes of the device pool adapter pages may hold (default 1 GiB). They share the
    pool with the KV cache, KV first: they take only free blocks and give them back before a
    sequence would be preempted."""
    lora_backend: LoRABackendName = "auto"
    """LoRA kernels, chosen like ``attention_backend``."""
    linear_backend: LinearBackendName = "auto"
    """The base model's dense projections: on CPU the C packed-panel kernel ("cpu", float32)
    when a C compiler is present, else torch's F.linear (always on CUDA)."""
    enforce_eager: bool = False
    """Run the model layer by layer through the backend objects. By default, on the CPU with
    every kernel in C (float32), the layers run as one flat run of prebound C calls (the CPU
    graph, vLLM's CUDA graphs in spirit): same kernels and results, ~20 ms less Python per step
    of a 30-layer model."""
    num_threads: int | None = None
    """torch intra-op threads on CPU; None leaves torch's default."""
    enable_prefix_caching: bool = True
    """Share the KV of full prompt blocks between requests with the same tokens, adapter version
    and tenant (--no-enable-prefix-caching turns it off)."""
    host_kv_cache_bytes: int = 0
    """Host RAM for KV blocks evicted from the accelerator pool (pinned on CUDA); 0 = no host tier.
    Cached blocks are demoted here on eviction and promoted back on a prefix hit."""
    disk_kv_path: str | None = None
    """Directory of the disk KV tier (block files with header and checksum; survives restarts)."""
    disk_kv_cache_bytes: int = 0
    """Cap of the disk KV tier in bytes (needs disk_kv_path); 0 = no disk tier."""
    preemption_mode: PreemptionMode = "auto"
    """What a preempted sequence's partial last block becomes (its full blocks stay in the prefix
    cache): "swap" to the host/disk tier and back, "recompute", or "auto" (swap when copying costs
    less than recomputing, by measured rates; recompute without a tier)."""
    max_logprobs: int = 20
    """Most logprobs (top alternatives per token) one request may ask for (vLLM's default)."""
    speculative_config: str | None = None
    """Speculative decoding, as vLLM's JSON (``LLM`` also takes the dict): {"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
    "disable_by_batch_size": 4}, or a draft model: {"method": "draft_model", "model": "/models/draft",
    "num_speculative_tokens": 4} (engine/speculative.py, engine/draft_model.py; docs/operations.md).
    None: off."""
    kv_events_config: str | None = None
    """KV cache events for routers, as vLLM's JSON: {"enable_kv_cache_events": true, "endpoint":
    "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "...", "buffer_steps": 10000, "hwm":
    100000, "max_queue_size": 100000}, and loraplex's "encoding": "array" or "map" (ZeroMQ PUB,
    msgpack; docs/operations.md, KV cache events)."""

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs at least one token per step"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.scheduling_policy not in POLICY_NAMES:
            raise ValueError(
                f"scheduling_policy must be one of {POLICY_NAMES}, got {self.scheduling_policy!r}"
            )
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1 (or None: as many as fit), got {self.max_loras}")
        if self.lora_page_rank < 1:
            raise ValueError(f"lora_page_rank must be >= 1, got {self.lora_page_rank}")
        if self.cpu_lora_memory is not None and self.cpu_lora_memory <= 0:
            raise ValueError(f"cpu_lora_memory must be > 0 bytes, got {self.cpu_lora_memory}")
        if self.lora_memory is not None and self.lora_memory <= 0:
            raise ValueError(f"lora_memory must be > 0 bytes, got {self.lora_memory}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.host_kv_cache_bytes < 0 or self.disk_kv_cache_bytes < 0:
            raise ValueError("host_kv_cache_bytes and disk_kv_cache_bytes must be >= 0")
        if self.disk_kv_cache_bytes > 0 and not self.disk_kv_path:
            raise ValueError(f"disk_kv_cache_bytes={self.disk_kv_cache_bytes} needs disk_kv_path")
        if self.disk_kv_path and self.disk_kv_cache_bytes == 0:
            # Silently serving without the tier asked for would look like a cold cache.
            raise ValueError(
                f"disk_kv_path={self.disk_kv_path!r} needs disk_kv_cache_bytes, the tier's cap "
                "(e.g. --disk-kv-cache-bytes 20GiB); the disk tier never grows past it"
            )
        if (self.host_kv_cache_bytes or self.disk_kv_cache_bytes) and not self.enable_prefix_caching:
            raise ValueError(
                "the host and disk KV tiers hold prefix-cache blocks: they need enable_prefix_caching=True"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.preemption_mode == "swap" and not (self.host_kv_cache_bytes or self.disk_kv_cache_bytes):
            raise ValueError(
                "preemption_mode='swap' needs a KV tier to swap to: "
                "set host_kv_cache_bytes or disk_kv_cache_bytes"
            )
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.speculative_config is not None:
            self.speculative  # noqa: B018 -- parsed now, so a bad value is refused at start-up
        if self.kv_events_config is not None:
            self.kv_events  # noqa: B018 -- parsed now, so a bad value is refused at start-up
        capped = self.max_loras is not None and self.max_cpu_loras is not None
        if capped and self.max_cpu_loras < self.max_loras:  # type: ignore[operator]
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """``kv_events_config`` parsed (None when unset)."""
        return None if self.kv_events_config is None else KVEventsConfig.parse(self.kv_events_config)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` parsed (None when unset)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def cpu_lora_capacity(self) -> int | None:
        """``max_cpu_loras``, or its default (None: bytes alone bound the host LRU)."""
        if self.max_cpu_loras is not None:
            return self.max_cpu_loras
        return None if self.max_loras is None else max(2 * self.max_loras, 8)

    @property
    def cpu_lora_memory_bytes(self) -> int:
        """``cpu_lora_memory``, or its default (2 GiB)."""
        return self.cpu_lora_memory if self.cpu_lora_memory is not None else DEFAULT_CPU_LORA_MEMORY

    @property
    def lora_memory_bytes(self) -> int:
        """``lora_memory``, or its default (1 GiB)."""
        return self.lora_memory if self.lora_memory is not None else DEFAULT_LORA_MEMORY


@dataclass(frozen=True)
class RuntimeInfo:
    """Values derived at start-up from the config, the model and the machine."""

    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    num_kv_blocks: int
    kv_bytes_per_block: int
    eos_token_ids: tuple[int, ...]
