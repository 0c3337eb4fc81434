"""Reference implementations that only the kernel tests and benchmarks use.

What the portable backend runs lives in ``loraplex/kernels/portable`` and serves as
the Triton kernels' reference from there; this module holds only what no backend calls.
"""

from __future__ import annotations

import torch


def swap_blocks(
    src_cache: torch.Tensor,  # [num_src_blocks, block_size, num_kv_heads, head_dim]
    dst_cache: torch.Tensor,  # [num_dst_blocks, block_size, num_kv_heads, head_dim]
    src_ids: torch.Tensor,  # [num_pairs] int64, on src_cache's device
    dst_ids: torch.Tensor,  # [num_pairs] int64, on dst_cache's device
) -> None:
    """``dst_cache[dst_ids[i]] = src_cache[src_ids[i]]`` across pools, possibly across devices.

    The reference of ``triton.cache_ops.copy_blocks_between`` (which stays on one device).
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
