"""Configuration of the adapter manager (frozen, validated when built)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loraplex.adapters.archive import ArchiveLimits


@dataclass(frozen=True)
class AdapterManagerConfig:
    """Sizes of the three adapter tiers and upload limits."""

    max_loras: int = 4
    """Device slots: distinct adapters one forward pass can serve."""
    max_lora_rank: int = 16
    """Largest rank accepted; every slot is padded to it."""
    max_cpu_loras: int = 16
    """Validated adapters kept in host memory (LRU); the rest are re-read from disk."""
    store_dir: Path | None = None
    """Disk tier folder for extracted/copied adapters; a temporary folder when None."""
    copy_directories: bool = True
    """Copy uploaded folders into the store (immutable); False serves them in place."""
    archive_limits: ArchiveLimits = field(default_factory=ArchiveLimits)
    """Bounds on uploaded archives."""
    num_loader_threads: int = 1
    """Background threads that read adapters from disk into the host tier."""

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras", "num_loader_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_lora_rank > 1024:
            raise ValueError(f"max_lora_rank {self.max_lora_rank} is implausibly large (limit 1024)")
