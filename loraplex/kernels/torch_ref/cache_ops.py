"""PyTorch KV block copies: copy-on-write within a pool, swaps between pools and devices.

These are the references of ``triton.cache_ops`` and also the only path for moves
across devices (GPU pool <-> host pool), which a Triton kernel cannot do.
"""

from __future__ import annotations

import torch


def copy_blocks_ref(
    caches: list[torch.Tensor],  # each [num_blocks, block_size, num_kv_heads, head_dim]
    src: torch.Tensor,  # [num_pairs] int64
    dst: torch.Tensor,  # [num_pairs] int64
) -> None:
    """``cache[dst[i]] = cache[src[i]]`` for every cache (all sources read before any write)."""
    if src.numel() == 0:
        return
    src_ids, dst_ids = src.long(), dst.long()
    for cache in caches:
        cache.index_copy_(0, dst_ids, cache.index_select(0, src_ids))


def swap_blocks(
    src_cache: torch.Tensor,  # [num_src_blocks, block_size, num_kv_heads, head_dim]
    dst_cache: torch.Tensor,  # [num_dst_blocks, block_size, num_kv_heads, head_dim]
    src_ids: torch.Tensor,  # [num_pairs] int64, on src_cache's device
    dst_ids: torch.Tensor,  # [num_pairs] int64, on dst_cache's device
) -> None:
    """``dst_cache[dst_ids[i]] = src_cache[src_ids[i]]`` across pools, possibly across devices.

    One gather on the source device, one transfer, one scatter on the destination
    device. Only host-to-GPU transfers are non-blocking: a non-blocking GPU-to-host
    copy could be read by the host-side scatter before it lands.
    """
    if src_ids.numel() == 0:
        return
    assert src_cache.shape[1:] == dst_cache.shape[1:], "pools hold differently shaped blocks"
    assert src_ids.shape == dst_ids.shape, "src_ids and dst_ids differ in length"
    blocks = src_cache.index_select(0, src_ids.to(src_cache.device, torch.int64))
    blocks = blocks.to(dst_cache.device, dst_cache.dtype, non_blocking=dst_cache.device.type == "cuda")
    dst_cache.index_copy_(0, dst_ids.to(dst_cache.device, torch.int64), blocks)
