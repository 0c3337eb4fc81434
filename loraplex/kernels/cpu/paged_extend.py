"""Launcher of the C paged extend kernel (``paged_extend.c``): prefill chunks over paged KV.

For prefill sequence s with query tokens ``query_start[s] .. query_start[s + 1] - 1``
and context ``seq_lens[s]`` (prefix = context - query length, already cached)::

    out[t, h] = softmax(scale * q[t, h] . K[s, :pos(t) + 1]^T) @ V[s, :pos(t) + 1]
    pos(t) = prefix + (t - query_start[s])                (causal, offset by the prefix)
    K[s] = cache[block_tables[s]] read in place (no gather); kv head of h = h // group
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from loraplex.kernels.cpu.build import bind, limit
from loraplex.kernels.metadata import PAD_BLOCK_ID

_SYMBOLS = {torch.float32: "loraplex_paged_extend_f32", torch.bfloat16: "loraplex_paged_extend_bf16"}
_ARGTYPES = (
    *[ctypes.c_void_p] * 7,
    *[ctypes.c_int64] * 9,
    ctypes.c_float,
    ctypes.c_int64,
    ctypes.c_float,
    ctypes.c_int64,
    ctypes.c_int,
)


def c_kernel(dtype: torch.dtype) -> Any | None:
    """The bound C entry point for ``dtype`` (float32, bfloat16), or None (no library, other dtype)."""
    symbol = _SYMBOLS.get(dtype)
    return None if symbol is None else bind(symbol, _ARGTYPES)


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when the C kernel can serve this dtype, device and head shape.

    Whether it is also the fast path is ``worth_it()``: the backend asks both.
    """
    if query.device.type != "cpu" or query.dtype != k_cache.dtype or c_kernel(query.dtype) is None:
        return False
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    # One KV head's query group must fit one work item's rows.
    return (
        num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= limit("loraplex_paged_extend_max_rows")
        and head_dim <= limit("loraplex_paged_extend_max_head_dim")
        and head_dim % limit("loraplex_paged_extend_head_dim_multiple") == 0
    )


def max_row_vectors() -> int:
    """The most row vectors one work item takes (3 of 16 floats with AVX-512, 6 of 8 with AVX2)."""
    return limit("loraplex_paged_extend_max_row_vectors")


def worth_it() -> bool:
    """True when the library was built with register tiles for this CPU (AVX-512 or AVX2).

    Elsewhere the compiler splits the kernel's vectors and it spills: the AVX-512 tile built
    for AVX2 measured 3.2 ms for 32 tokens over 1,056 (torch: 0.74) and 40 ms for a 1,056-token
    prefill (torch: 13). With its own AVX2 tiles (``paged_extend_avx2.h``) on an AVX2-only EPYC:
    0.84-0.91 ms against torch's 1.2-1.3 ms, and 15.7 ms against 21 ms for the prefill. The
    kernel stays correct everywhere and is tested on every machine."""
    return limit("loraplex_paged_extend_register_tile") == 1


def paged_extend_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], any row stride (a view into fused qkv rows)
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context after this step
    query_start: torch.Tensor,  # [num_seqs + 1] int32, offsets into query (query_start[0] may be > 0)
    scale: float,
    out: torch.Tensor | None = None,  # like query
    *,
    max_row_vectors: int = 0,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context (call ``supports`` first).

    The new tokens' K/V must already be in the cache (``write_kv`` runs first). The
    kernel reads the first ``ceil(seq_lens[s] / block_size)`` entries of each table
    row and reports a block id outside ``[0, num_blocks)`` (``PAD_BLOCK_ID``
    included) instead of reading it, as it does a query length < 1 or longer than the
    context: this raises ``ValueError`` then. ``max_row_vectors`` caps the query rows of
    one work item at that many row vectors (of 16 floats with AVX-512, 8 with AVX2; 0: the
    kernel's own choice; tests use it to reach every tile shape).

    With ``sliding_window`` W a token at position p sees keys p - W + 1 .. p, and a work
    item starts reading at the block of its first row's first key (the entries before may
    be ``PAD_BLOCK_ID``); ``logit_softcap`` caps the scaled scores (``c * tanh(s / c)``).
    """
    # Cheap checks only (this runs per layer per step); the kernel validates the
    # index arrays it reads (query_start, seq_lens, block ids) and reports them.
    num_tokens, num_heads, head_dim = query.shape
    num_cache_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if not (k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape):
        raise ValueError("cache shapes")
    if not (num_heads % num_kv_heads == 0):
        raise ValueError("query heads must be a multiple of the KV heads (GQA)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("caches must be contiguous")
    if not (block_tables.dtype == torch.int32 and block_tables.stride(1) == 1):
        raise ValueError("block_tables: int32 rows")
    if not (block_tables.shape[0] >= num_seqs):
        raise ValueError("block_tables rows")
    if not (seq_lens.dtype == torch.int32 and query_start.dtype == torch.int32):
        raise ValueError("seq_lens, query_start: int32")
    if not (query_start.shape[0] == num_seqs + 1):
        raise ValueError("query_start: [num_seqs + 1]")
    if not (seq_lens.stride(0) == 1 and query_start.stride(0) == 1):
        raise ValueError("seq_lens, query_start: contiguous")
    if not (query.stride(2) == 1 and query.stride(1) == head_dim):  # rows of heads, any row stride
        query = query.contiguous()
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    if not (out.shape == query.shape and out.dtype == query.dtype and out.is_contiguous()):
        raise ValueError("out")
    if num_seqs == 0 or num_tokens == 0:
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
        query_start.data_ptr(),
        out.data_ptr(),
        query.stride(0),
        num_tokens,
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
        max_row_vectors,
        torch.get_num_threads(),
    )
    if bad_items:
        raise ValueError(
            f"paged extend: {bad_items} sequences or work items had query rows outside the batch's "
            f"{num_tokens} tokens, a query length < 1 or above the context, or a block id outside "
            f"[0, {num_cache_blocks}), such as PAD_BLOCK_ID ({PAD_BLOCK_ID}) within seq_len"
        )
    return out
