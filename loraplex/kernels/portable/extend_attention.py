"""Prefill / chunked-prefill attention in PyTorch, one sequence at a time.

A sequence's context is gathered through its block table into a contiguous tensor,
then attended with SDPA under a causal mask offset by the cached prefix length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.kernels.metadata import PAD_BLOCK_ID
from loraplex.kernels.portable.paged_decode import soft_cap


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks_per_seq] int32, PAD_BLOCK_ID-padded
    context_len: int,
    first_block: int = 0,
) -> torch.Tensor:  # [context_len - first_block * block_size, num_kv_heads, head_dim]
    """One sequence's K (or V) as a contiguous tensor, read through its block table.

    Reads entries ``first_block .. ceil(context_len / block_size) - 1`` (a sliding window
    starts past 0: the entries before may be padding) and returns positions
    ``first_block * block_size .. context_len - 1``; raises ``ValueError`` if one of them
    is padding (a negative id would otherwise fail inside ``index_select`` with no hint
    of the cause).
    """
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    block_ids = block_table[first_block:num_blocks]
    if bool((block_ids < 0).any()):
        raise ValueError(
            f"block ids {block_ids.tolist()} of a {context_len}-token context hold PAD_BLOCK_ID "
            f"({PAD_BLOCK_ID}): the table is padded inside the used range"
        )
    blocks = cache.index_select(0, block_ids.long())
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[: context_len - first_block * block_size]


def extend_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    scale: float,
    *,
    key_start: int = 0,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """Causal attention of the last ``query_len`` positions over the whole context.

    Query row j sits at position prefix + j (prefix = key_start + context_len - query_len:
    ``key`` holds positions ``key_start ..``) and sees keys 0 .. prefix + j, or the last
    ``sliding_window`` of them. ``logit_softcap`` caps the scaled scores (fp32 math then).
    """
    query_len, num_heads, _ = query.shape
    context_len, num_kv_heads, _ = key.shape
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
    k = key.transpose(0, 1).unsqueeze(0)
    v = value.transpose(0, 1).unsqueeze(0)
    gqa = num_heads != num_kv_heads
    if sliding_window or logit_softcap or key_start:
        rows = (context_len - query_len + torch.arange(query_len, device=query.device))[:, None]
        cols = torch.arange(context_len, device=query.device)[None, :]
        mask = cols <= rows
        if sliding_window:
            mask &= cols > rows - sliding_window
        if not logit_softcap:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
            return out.squeeze(0).transpose(0, 1)
        group = num_heads // num_kv_heads
        kf = k.float().repeat_interleave(group, dim=1)
        vf = v.float().repeat_interleave(group, dim=1)
        scores = soft_cap(torch.matmul(q.float(), kf.transpose(-1, -2)).mul_(scale), logit_softcap)
        scores.masked_fill_(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), vf).to(query.dtype)
        return out.squeeze(0).transpose(0, 1)
    if query_len == context_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        prefix = context_len - query_len
        rows = torch.arange(query_len, device=query.device)[:, None]
        cols = torch.arange(context_len, device=query.device)[None, :]
        mask = cols <= rows + prefix
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)
