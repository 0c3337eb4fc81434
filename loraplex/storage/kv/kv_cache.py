"""The KV tensors themselves and how many blocks a memory budget buys.

Per layer, K and V are each ``[num_blocks, block_size, num_kv_heads, head_dim]``
(see ``loraplex.kernels.contracts``). One block costs, over all layers::

    bytes_per_block = 2 (K, V) * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes

Outside the accelerator pool (host and disk tiers, swap) one block's KV travels as a
single tensor ``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``
(``KVBlockLayout.block_shape``); ``KVCache.read_blocks`` / ``write_blocks`` convert.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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
    """How many blocks the device pool gets: bytes on CPU, a fraction of free memory on CUDA.

    The pool holds the KV cache and, with LoRA on, the adapter pages too (``kv_arena``:
    they borrow free blocks, at most ``lora_memory`` of them).
    """
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


@dataclass(frozen=True)
class KVBlockLayout:
    """What one block's KV looks like: every tier stores and checks blocks by this."""

    num_layers: int
    block_size: int  # tokens per block
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        dims = (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)
        if min(dims) < 1:
            raise ValueError(f"a KV block layout needs positive dimensions, got {self}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    @property
    def dtype_name(self) -> str:
        """``float32``, ``bfloat16``...: the dtype as stored in disk-block headers."""
        return str(self.dtype).removeprefix("torch.")


class KVCache:
    """Per-layer K and V block tensors for one model on one device.

    ``read_blocks`` / ``write_blocks`` / ``synchronize`` move whole blocks in and out
    (the ``DeviceBlockIO`` protocol the KV tiers use for demotion, promotion and swap).
    """

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
        self.device = device
        self.layout = KVBlockLayout(num_layers, block_size, num_kv_heads, head_dim, dtype)
        self.k: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        self.v: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        # Byte views of the same memory for block copies on CPU (see ``_byte_view``).
        self._k_bytes = _byte_views(self.k) if device.type == "cpu" else []
        self._v_bytes = _byte_views(self.v) if device.type == "cpu" else []
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

    def read_blocks(self, block_ids: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
        """Copy device blocks ``block_ids`` into host tensors ``outs``; complete when it returns.

        outs: one contiguous CPU tensor ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` per block.
        """
        self._check_blocks(block_ids, outs)
        if self.device.type == "cpu":
            for block_id, out in zip(block_ids, outs, strict=True):
                dst = _byte_view(out)
                for layer, (k_layer, v_layer) in enumerate(zip(self._k_bytes, self._v_bytes, strict=True)):
                    dst[layer, 0] = k_layer[block_id]
                    dst[layer, 1] = v_layer[block_id]
            return
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        staged = torch.empty(
            (len(block_ids), *self.layout.block_shape), dtype=self.layout.dtype, device=self.device
        )
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            staged[:, layer, 0] = k.index_select(0, ids)
            staged[:, layer, 1] = v.index_select(0, ids)
        for out, block in zip(outs, staged.cpu(), strict=True):
            out.copy_(block)

    def write_blocks(self, block_ids: Sequence[int], blocks: Sequence[torch.Tensor]) -> None:
        """Copy host tensors ``blocks`` into device blocks ``block_ids``, before later work on the device.

        blocks: one contiguous CPU tensor ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` per block.
        On CUDA the copy may still run when this returns; ``synchronize`` waits for it.
        """
        self._check_blocks(block_ids, blocks)
        if self.device.type == "cpu":
            for block_id, block in zip(block_ids, blocks, strict=True):
                src = _byte_view(block)
                for layer, (k_layer, v_layer) in enumerate(zip(self._k_bytes, self._v_bytes, strict=True)):
                    k_layer[block_id] = src[layer, 0]
                    v_layer[block_id] = src[layer, 1]
            return
        # One pinned staging buffer, one host-to-device copy, then a gather per layer on the device.
        staging = torch.empty(
            (len(blocks), *self.layout.block_shape), dtype=self.layout.dtype, pin_memory=True
        )
        for row, block in zip(staging, blocks, strict=True):
            row.copy_(block)
        staged = staging.to(self.device, non_blocking=True)
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            k.index_copy_(0, ids, staged[:, layer, 0])
            v.index_copy_(0, ids, staged[:, layer, 1])

    def synchronize(self) -> None:
        """Wait for this device's queued block copies (no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _check_blocks(self, block_ids: Sequence[int], blocks: Sequence[torch.Tensor]) -> None:
        if len(block_ids) != len(blocks):
            raise ValueError(f"{len(block_ids)} block ids for {len(blocks)} host blocks")
        expected = (self.layout.block_shape, self.layout.dtype)
        for block in blocks:
            found = (tuple(block.shape), block.dtype)
            if found != expected or block.device.type != "cpu" or not block.is_contiguous():
                raise ValueError(
                    f"host block is {found} on {block.device}, expected contiguous CPU {expected}"
                )
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise IndexError(f"block ids {bad[:5]} outside the pool of {self.num_blocks} blocks")


# Block copies on CPU go through numpy views of the raw bytes, made once per tensor.
# Measured with SmolLM2's layout (128 blocks, 90 MiB, 2 shared and busy cores): numpy
# assignment per block and layer took ~65 ms for 128 blocks, torch's ``copy_`` per
# block and layer ~230 ms, ``torch.stack`` / ``_foreach_copy_`` per block 100-140 ms,
# ``index_copy_`` per layer ~350 ms and ``index_select`` gathers up to 2 s. Bytes
# (uint8) also cover dtypes numpy lacks (bfloat16).
def _byte_view(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


def _byte_views(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    return [_byte_view(t) for t in tensors]
