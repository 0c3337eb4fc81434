"""Configuration of the adapter manager (frozen, validated when built)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loraplex.adapters.archive import ArchiveLimits


@dataclass(frozen=True)
class AdapterManagerConfig:
    """Sizes of the three adapter tiers and upload limits."""

    max_loras: int | None = None
    """Optional cap on resident adapters (vLLM's name); None: as many as ``lora_memory`` holds."""
    max_lora_rank: int = 16
    """Largest rank accepted (validation only: pages hold ``lora_page_rank`` rows each)."""
    lora_page_rank: int = 8
    """Rank rows per adapter page: an adapter of rank r takes ceil(r / lora_page_rank) pages."""
    lora_memory: int = 1 << 30
    """Bytes of accelerator memory for adapter pages (all groups together)."""
    max_cpu_loras: int | None = 16
    """Most validated adapters kept in host memory (LRU; None: no count cap); the rest are
    re-read from the store."""
    cpu_lora_memory: int | None = None
    """Most bytes of adapter weights kept in host memory (None: no byte cap)."""
    store_dir: Path | None = None
    """Disk tier folder for extracted/copied adapters; a temporary folder when None."""
    copy_directories: bool = True
    """Copy uploaded folders into the store (immutable); False serves them in place."""
    archive_limits: ArchiveLimits = field(default_factory=ArchiveLimits)
    """Bounds on uploaded archives."""
    num_loader_threads: int = 1
    """Background threads that read adapters from disk into the host tier."""

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras", "num_loader_threads", "lora_page_rank"):
            value = getattr(self, name)
            if name in ("max_loras", "max_cpu_loras") and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        memory = self.lora_memory
        if isinstance(memory, bool) or not isinstance(memory, int) or memory < 1:
            raise ValueError(f"lora_memory must be a positive number of bytes, got {self.lora_memory!r}")
        host = self.cpu_lora_memory
        if host is not None and (isinstance(host, bool) or not isinstance(host, int) or host < 1):
            raise ValueError(f"cpu_lora_memory must be a positive number of bytes, got {host!r}")
        if self.max_lora_rank > 1024:
            raise ValueError(f"max_lora_rank {self.max_lora_rank} is implausibly large (limit 1024)")
