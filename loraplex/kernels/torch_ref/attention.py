"""PyTorch paged attention: the engine's CPU path and the Triton kernels' reference.

Decode sequences are served together: their blocks are gathered into one padded
``[num_decodes, max_len, kv_heads, head_dim]`` view and masked by length, so a batch
of decodes costs one gather and one fused SDPA call. Prefill/extend chunks are
served one sequence at a time with an explicit causal mask offset by the cached
prefix length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.kernels.backend import AttentionBackend
from loraplex.kernels.metadata import AttentionMetadata


def write_kv_ref(
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


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_seq_blocks] int32
    context_len: int,
) -> torch.Tensor:  # [context_len, num_kv_heads, head_dim]
    """One sequence's K (or V) as a contiguous tensor, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:context_len]


def paged_decode_ref(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence attends to all of its ``seq_lens[i]`` cached tokens.

    out[i] = softmax(q[i] . K[i, :len]^T * scale) @ V[i, :len]
    with K[i] = cache[block_tables[i]] flattened (GQA: head h reads kv head h // group).
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    num_blocks = -(-max_len // block_size)
    table = block_tables[:, :num_blocks].long()
    # [num_seqs, num_blocks, block_size, kv_heads, D] -> [num_seqs, kv_heads, L, D]
    k = k_cache[table].view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    v = v_cache[table].view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    k = k.transpose(1, 2)
    v = v.transpose(1, 2)
    positions = torch.arange(num_blocks * block_size, device=query.device)
    valid = positions[None, :] < seq_lens[:, None].to(positions.dtype)  # [num_seqs, L]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [num_seqs, num_heads, 1, D]
        k,
        v,
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.squeeze(2)


def extend_attention_ref(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """Causal attention of the last ``query_len`` positions over the whole context.

    Query row j sits at position prefix + j (prefix = context_len - query_len) and sees
    keys 0 .. prefix + j.
    """
    query_len, num_heads, _ = query.shape
    context_len, num_kv_heads, _ = key.shape
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
    k = key.transpose(0, 1).unsqueeze(0)
    v = value.transpose(0, 1).unsqueeze(0)
    gqa = num_heads != num_kv_heads
    if query_len == context_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        prefix = context_len - query_len
        rows = torch.arange(query_len, device=query.device)[:, None]
        cols = torch.arange(context_len, device=query.device)[None, :]
        mask = cols <= rows + prefix
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)


class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain PyTorch; runs anywhere, tuned for the CPU."""

    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd > 0:
            out[:nd] = paged_decode_ref(
                query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale
            )
        starts = meta.query_start_loc_cpu or tuple(meta.query_start_loc.tolist())
        lens = meta.seq_lens_cpu or tuple(meta.seq_lens.tolist())
        for i in range(nd, meta.num_seqs):
            lo, hi, ctx = starts[i], starts[i + 1], lens[i]
            k = gather_context(k_cache, meta.block_tables[i], ctx)
            v = gather_context(v_cache, meta.block_tables[i], ctx)
            out[lo:hi] = extend_attention_ref(query[lo:hi], k, v, scale)
        return out

    def copy_blocks(self, caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.numel() == 0:
            return
        for cache in caches:
            cache.index_copy_(0, dst.long(), cache.index_select(0, src.long()))
