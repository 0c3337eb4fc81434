"""KV cache ops: store new K/V at their slots, copy whole blocks within or between pools.

``write_kv`` runs once per layer per step, before attention. ``copy_blocks`` serves
copy-on-write (a shared last block is duplicated before a sequence appends to it)
and ``copy_blocks_between`` moves blocks between two pools on the same device
(swap out to / in from a staging pool). Moving blocks across devices (GPU <-> host)
needs a plain ``index_select`` + ``copy_`` in torch instead: a Triton kernel cannot
read host memory.

One launch per cache tensor: the interpreter cannot follow raw pointer arrays, and
on the GPU the launches are tiny next to the attention they precede.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.triton.common import SUPPORTED_DTYPES, pow2_at_least


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot >= 0:
        block_id = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        offs_h = tl.arange(0, KV_HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(
            key_ptr + tok * stride_key_tok + offs_h[:, None] * stride_key_head + offs_d[None, :], mask=mask
        )
        v = tl.load(
            value_ptr + tok * stride_value_tok + offs_h[:, None] * stride_value_head + offs_d[None, :],
            mask=mask,
        )
        k_dst = block_id * stride_kc_block + offset * stride_kc_slot + offs_h[:, None] * stride_kc_head
        v_dst = block_id * stride_vc_block + offset * stride_vc_slot + offs_h[:, None] * stride_vc_head
        tl.store(k_cache_ptr + k_dst + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + v_dst + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (or int32), -1 = skip
) -> None:
    """Scatter each token's K/V row into the cache slot ``slot_mapping[t]``.

    for t with slot = slot_mapping[t] >= 0:
        k_cache[slot // block_size, slot % block_size] = key[t]
        v_cache[slot // block_size, slot % block_size] = value[t]
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim), (
        f"k_cache {tuple(k_cache.shape)} does not hold [*, *, {num_kv_heads}, {head_dim}] rows"
    )
    assert v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}"
    assert k_cache.dtype in SUPPORTED_DTYPES and v_cache.dtype == k_cache.dtype, "unsupported cache dtype"
    assert key.stride(2) == 1 and value.stride(2) == 1, "key/value rows must be contiguous in head_dim"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache rows must be contiguous in head_dim"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)} != [{num_tokens}]"
    assert slot_mapping.dtype in (torch.int64, torch.int32), "slot_mapping must be an integer tensor"
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=pow2_at_least(num_kv_heads, 1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=pow2_at_least(head_dim, 1), PAGE_SIZE=k_cache.shape[1],
        num_warps=1,
    )  # fmt: skip


@triton.jit
def _copy_blocks_kernel(
    src_cache_ptr,
    dst_cache_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    block_numel,
    stride_src_block,
    stride_dst_block,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ids_ptr + pair).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    vals = tl.load(src_cache_ptr + src * stride_src_block + offs, mask=mask)
    tl.store(dst_cache_ptr + dst * stride_dst_block + offs, vals, mask=mask)


def _block_is_contiguous(cache: torch.Tensor) -> bool:
    """Whether each block of a 4-D cache is one dense run of memory."""
    _, _, heads, dim = cache.shape
    return cache.stride(3) == 1 and cache.stride(2) == dim and cache.stride(1) == heads * dim


def copy_blocks_between(
    src_cache: torch.Tensor,  # [num_src_blocks, block_size, num_kv_heads, head_dim]
    dst_cache: torch.Tensor,  # [num_dst_blocks, block_size, num_kv_heads, head_dim]
    src_ids: torch.Tensor,  # [num_pairs] int64
    dst_ids: torch.Tensor,  # [num_pairs] int64
) -> None:
    """Copy block ``src_ids[i]`` of ``src_cache`` to block ``dst_ids[i]`` of ``dst_cache``.

    for i in range(num_pairs):
        dst_cache[dst_ids[i]] = src_cache[src_ids[i]]      (whole block, all heads)
    (pairs run in parallel: a block must not be both a source and a destination)
    """
    assert src_cache.device == dst_cache.device, "copy_blocks_between needs both pools on one device"
    assert src_cache.dtype == dst_cache.dtype, f"dtypes differ: {src_cache.dtype} vs {dst_cache.dtype}"
    assert src_cache.shape[1:] == dst_cache.shape[1:], "pools hold differently shaped blocks"
    assert _block_is_contiguous(src_cache) and _block_is_contiguous(dst_cache), "blocks must be contiguous"
    assert src_ids.dim() == 1 and src_ids.shape == dst_ids.shape, "src_ids and dst_ids are [num_pairs]"
    assert src_ids.dtype in (torch.int64, torch.int32) and dst_ids.dtype in (torch.int64, torch.int32)
    num_pairs = src_ids.shape[0]
    if num_pairs == 0:
        return
    block_numel = src_cache[0].numel()
    chunk = min(4096, pow2_at_least(block_numel, 128))
    grid = (num_pairs, triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        src_cache, dst_cache, src_ids, dst_ids, block_numel,
        src_cache.stride(0), dst_cache.stride(0), BLOCK=chunk, num_warps=4,
    )  # fmt: skip


def copy_blocks(
    caches: list[torch.Tensor],  # each [num_blocks, block_size, num_kv_heads, head_dim]
    src: torch.Tensor,  # [num_pairs] int64
    dst: torch.Tensor,  # [num_pairs] int64
) -> None:
    """Copy-on-write: duplicate block ``src[i]`` into ``dst[i]`` in every cache tensor.

    for cache in caches:
        for i in range(num_pairs): cache[dst[i]] = cache[src[i]]
    (destinations are fresh blocks, so no pair reads a block another pair writes)
    """
    for cache in caches:
        copy_blocks_between(cache, cache, src, dst)
