"""KV cache writes by slot and copy-on-write block copies, in plain PyTorch."""

from __future__ import annotations

import torch


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Scatter K/V rows into their flat slots ``block_id * block_size + offset``."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))


def copy_blocks(
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
