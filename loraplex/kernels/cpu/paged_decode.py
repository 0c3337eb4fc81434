"""Launcher of the C paged decode kernel (``paged_decode.c``).

out[s, h] = softmax(scale * q[s, h] . K[s, :len]^T) @ V[s, :len]
K[s] = cache[block_tables[s]] read in place, block by block (no gather)
kv head of query head h = h // (num_heads / num_kv_heads)   (GQA)
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from loraplex.kernels.cpu.build import bind, limit
from loraplex.kernels.metadata import PAD_BLOCK_ID

_SYMBOLS = {torch.float32: "loraplex_paged_decode_f32", torch.bfloat16: "loraplex_paged_decode_bf16"}
_ARGTYPES = (
    *[ctypes.c_void_p] * 6,
    *[ctypes.c_int64] * 8,
    ctypes.c_float,
    ctypes.c_int64,
    ctypes.c_float,
    ctypes.c_int,
)


def c_kernel(dtype: torch.dtype) -> Any | None:
    """The bound C entry point for ``dtype`` (float32, bfloat16), or None (no library, other dtype)."""
    symbol = _SYMBOLS.get(dtype)
    return None if symbol is None else bind(symbol, _ARGTYPES)


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when the C kernel can serve this dtype, device and head/block shape."""
    if query.device.type != "cpu" or query.dtype != k_cache.dtype or c_kernel(query.dtype) is None:
        return False
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    # One KV head's query group must fit the kernel's per-work-item stack buffers.
    return (
        group <= limit("loraplex_paged_decode_max_rows")
        and group * head_dim <= limit("loraplex_paged_decode_max_rows_dim")
        and block_size <= limit("loraplex_paged_decode_max_block_size")
        and head_dim <= limit("loraplex_paged_decode_max_head_dim")
    )


def paged_decode_cpu(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], any row stride (a view into fused qkv rows)
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, each >= 1
    scale: float,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention with the C kernel; call ``supports`` first (this asserts it).

    With ``sliding_window`` W the query sees the last W keys and the kernel starts at the
    block holding the first of them (the entries before may be ``PAD_BLOCK_ID``);
    ``logit_softcap`` caps the scaled scores (``c * tanh(s / c)``).

    The kernel reads the first ``ceil(seq_lens[i] / block_size)`` entries of each
    table row (the ``PAD_BLOCK_ID`` padding after them is never read) and reports any
    of them outside ``[0, num_blocks)``, padding included, instead of reading it:
    this raises ``ValueError`` then.
    """
    if not supports(query, k_cache):
        raise ValueError("C paged decode does not support these shapes or dtype")
    num_seqs, num_heads, head_dim = query.shape
    num_cache_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if not (cache_head_dim == head_dim and num_heads % num_kv_heads == 0):
        raise ValueError("head shapes disagree")
    if not (v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype):
        raise ValueError("v_cache differs from k_cache")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("caches must be contiguous")
    if not (block_tables.dtype == torch.int32 and block_tables.dim() == 2):
        raise ValueError("block_tables: int32 [seqs, blocks]")
    if not (block_tables.shape[0] >= num_seqs and block_tables.stride(1) == 1):
        raise ValueError("block_tables rows")
    if not (seq_lens.dtype == torch.int32 and seq_lens.shape[0] >= num_seqs):
        raise ValueError("seq_lens: int32 [seqs]")
    if not (query.stride(2) == 1 and query.stride(1) == head_dim):  # rows of heads, any row stride
        query = query.contiguous()
    seq_lens = seq_lens.contiguous()
    if out is None:
        out = torch.empty_like(query)
    if not (out.shape == query.shape and out.dtype == query.dtype and out.is_contiguous()):
        raise ValueError("out")
    if num_seqs == 0:
        return out
    kernel = c_kernel(query.dtype)
    if kernel is None:
        raise RuntimeError("the C kernel is not built")
    bad_items = kernel(
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        query.stride(0),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        block_tables.stride(0),
        num_cache_blocks,
        scale,
        sliding_window or 0,
        logit_softcap or 0.0,
        torch.get_num_threads(),
    )
    if bad_items:
        raise ValueError(
            f"paged decode: {bad_items} (sequence, kv head) items had seq_len < 1 or a block id "
            f"outside [0, {num_cache_blocks}), such as PAD_BLOCK_ID ({PAD_BLOCK_ID}) within seq_len"
        )
    return out
