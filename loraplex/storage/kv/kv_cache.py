"""The KV tensors themselves and how many blocks a memory budget buys.

Per layer, K and V are each ``[num_blocks, block_size, num_kv_heads, head_dim]``
(see ``loraplex.kernels.backend``). One block costs, over all layers::

    bytes_per_block = 2 (K, V) * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 << 30


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block occupies across every layer's K and V cache."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def _available_host_bytes() -> int:
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES")
        page_size = os.sysconf("SC_PAGE_SIZE")
        return int(pages * page_size)
    except (ValueError, OSError):  # not every platform exposes these
        return 8 << 30


def num_blocks_for_budget(
    bytes_per_block: int,
    device: torch.device,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
) -> int:
    """How many blocks fit the budget: bytes on CPU, a fraction of free memory on CUDA."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free
        budget = int(total * gpu_memory_utilization) - in_use
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization={gpu_memory_utilization} leaves no room for KV: "
                f"{in_use / 2**30:.1f} GiB of {total / 2**30:.1f} GiB already in use"
            )
    else:
        if kv_cache_memory is None:
            budget = min(DEFAULT_CPU_KV_BYTES, _available_host_bytes() // 4)
        else:
            budget = kv_cache_memory
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV budget of {budget} bytes is smaller than one block ({bytes_per_block} bytes); "
            "raise kv_cache_memory / gpu_memory_utilization or lower block_size"
        )
    return int(num_blocks)


class KVCache:
    """Per-layer K and V block tensors for one model on one device."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        self.v: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        logger.info(
            "KV cache: %d blocks x %d tokens (%d token slots), %.1f MiB",
            num_blocks,
            block_size,
            num_blocks * block_size,
            2 * num_layers * self.k[0].numel() * self.k[0].element_size() / 2**20,
        )

    @property
    def all_tensors(self) -> list[torch.Tensor]:
        return self.k + self.v
