"""Paged decode attention in PyTorch: one query token per sequence over its block table.

Consecutive sequences are served in chunks sized to stay in cache: each chunk's
blocks are gathered into a reused buffer and attended in one go, with the GQA query
group as the query rows, so K/V are never repeated per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.kernels.metadata import check_block_tables, first_visible_block

# Gathered K+V bytes per decode chunk: about one core's L2, so the copy is still
# cache-resident when the attention reads it (one big gather would round-trip DRAM).
DECODE_CHUNK_BYTES = 1 << 20


class GatherWorkspace:
    """Reusable buffers for gathered K/V blocks, one pair per (dtype, device, block shape).

    Decode runs every layer of every step; a fresh ``index_select`` result each time
    would be a fresh allocation (and on the CPU, often fresh page faults).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device, tuple[int, ...]], tuple[torch.Tensor, ...]] = {}

    def get(self, cache: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two ``[num_blocks, block_size, num_kv_heads, head_dim]`` buffers (K and V)."""
        key = (cache.dtype, cache.device, tuple(cache.shape[1:]))
        bufs = self._buffers.get(key)
        if bufs is None or bufs[0].shape[0] < num_blocks:
            shape = (num_blocks, *cache.shape[1:])
            bufs = tuple(torch.empty(shape, dtype=cache.dtype, device=cache.device) for _ in range(2))
            self._buffers[key] = bufs
        return bufs[0][:num_blocks], bufs[1][:num_blocks]


def soft_cap(scores: torch.Tensor, logit_softcap: float | None) -> torch.Tensor:
    """``c * tanh(scores / c)`` (Gemma 2's attention and final logit soft-capping), in place
    where it can; ``scores`` unchanged without a cap."""
    if not logit_softcap:
        return scores
    return scores.div_(logit_softcap).tanh_().mul_(logit_softcap)


def _decode_attention_fp32(
    q: torch.Tensor,  # [chunk, kv_heads, group, D]
    k: torch.Tensor,  # [chunk, kv_heads, len, D]
    v: torch.Tensor,  # [chunk, kv_heads, len, D]
    mask: torch.Tensor | None,  # [chunk, 1, 1, len] bool
    scale: float,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [chunk, kv_heads, group, D]
    """Plain matmul-softmax-matmul: with a handful of query rows per KV head, the CPU
    flash kernel behind SDPA runs about 1.5x slower than two batched GEMMs. fp32 only,
    since the scores would otherwise be rounded to the input dtype before the softmax."""
    scores = soft_cap(torch.matmul(q, k.transpose(-1, -2)).mul_(scale), logit_softcap)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, PAD_BLOCK_ID-padded
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_seq_len: int | None = None,
    *,
    seq_lens_cpu: tuple[int, ...] | None = None,
    workspace: GatherWorkspace | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence attends to all of its ``seq_lens[i]`` cached tokens.

    out[i] = softmax(q[i] . K[i, :len]^T * scale) @ V[i, :len]
    with K[i] = cache[block_tables[i]] flattened (GQA: head h reads kv head h // group).

    Consecutive sequences are served in chunks of about ``DECODE_CHUNK_BYTES`` of
    gathered K/V: one ``index_select`` per cache (into ``workspace`` buffers when
    given) and one attention per chunk, with the query group of each KV head as the
    query rows (no K/V repeat for GQA) and a length mask only when the chunk's
    lengths differ. fp32 runs two batched GEMMs and a softmax, half dtypes SDPA.
    ``max_seq_len`` is accepted for compatibility; lengths come from ``seq_lens_cpu``
    (or ``seq_lens``). Raises ``ValueError`` if a used block-table entry is padding.

    With ``sliding_window`` W the query (at position len - 1) sees the last W keys only,
    and the blocks before the first of them are never read (they may be padding): each
    sequence is served from its first visible block on. ``logit_softcap`` caps the scaled
    scores (fp32 math for every dtype then: SDPA has no cap).
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    lens = list(seq_lens_cpu) if seq_lens_cpu else [int(n) for n in seq_lens.tolist()]
    if sliding_window:
        firsts = [first_visible_block(n - 1, sliding_window, block_size) for n in lens]
        check_block_tables(block_tables, lens, block_size, firsts)
        return _windowed_decode(
            query, k_cache, v_cache, block_tables, lens, firsts, scale, sliding_window, logit_softcap
        )
    check_block_tables(block_tables, lens, block_size)
    out = torch.empty_like(query)
    row_bytes = 2 * num_kv_heads * head_dim * k_cache.element_size()
    start = 0
    while start < num_seqs:
        end, chunk_len = start + 1, lens[start]
        while end < num_seqs:
            grown_len = max(chunk_len, lens[end])
            if grown_len * (end + 1 - start) * row_bytes > DECODE_CHUNK_BYTES:
                break
            chunk_len, end = grown_len, end + 1
        num_chunk = end - start
        chunk_lens = lens[start:end]
        blocks_per_seq = -(-chunk_len // block_size)
        block_ids = block_tables[start:end, :blocks_per_seq].reshape(-1)
        mask = None
        if min(chunk_lens) != chunk_len:
            # Shorter sequences' rows reach into their padding: read block 0 there (the
            # used entries were checked above) and mask those positions out.
            block_ids = block_ids.clamp(min=0)
            limits = torch.tensor(chunk_lens, device=query.device)
            positions = torch.arange(chunk_len, device=query.device)
            mask = (positions[None, :] < limits[:, None]).view(num_chunk, 1, 1, chunk_len)
        if workspace is not None:
            k_buf, v_buf = workspace.get(k_cache, num_chunk * blocks_per_seq)
            k_blocks = torch.index_select(k_cache, 0, block_ids, out=k_buf)
            v_blocks = torch.index_select(v_cache, 0, block_ids, out=v_buf)
        else:
            k_blocks = k_cache.index_select(0, block_ids)
            v_blocks = v_cache.index_select(0, block_ids)
        # [chunk, blocks * block_size, kv_heads, D] -> [chunk, kv_heads, chunk_len, D] (a view)
        k = k_blocks.view(num_chunk, -1, num_kv_heads, head_dim)[:, :chunk_len].transpose(1, 2)
        v = v_blocks.view(num_chunk, -1, num_kv_heads, head_dim)[:, :chunk_len].transpose(1, 2)
        q = query[start:end].reshape(num_chunk, num_kv_heads, group, head_dim)
        if logit_softcap:
            o = _decode_attention_fp32(q.float(), k.float(), v.float(), mask, scale, logit_softcap).to(
                query.dtype
            )
        elif query.dtype == torch.float32:
            o = _decode_attention_fp32(q, k, v, mask, scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.reshape(num_chunk, num_heads, head_dim)
        start = end
    return out


def _windowed_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: list[int],
    firsts: list[int],  # first visible block per sequence
    scale: float,
    sliding_window: int,
    logit_softcap: float | None,
) -> torch.Tensor:
    """Decode under a sliding window: all sequences in one gather of their visible blocks
    (at most ``ceil(W / B) + 1`` each, however long the context), positions before the
    window or past the length masked. The window bounds the gather, so no chunking."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    device = query.device
    num_used = [-(-n // block_size) for n in lens]
    width = max(u - f for u, f in zip(num_used, firsts, strict=True))
    first = torch.tensor(firsts, device=device)
    cols = first[:, None] + torch.arange(width, device=device)[None, :]  # [seqs, width] table columns
    in_use = cols < torch.tensor(num_used, device=device)[:, None]
    ids = block_tables[:num_seqs].gather(1, cols.clamp(max=block_tables.shape[1] - 1))
    # Columns past a sequence's blocks read its first visible block again (masked below):
    # any other id might be a freed block, whose contents are anything. Used ids were checked.
    ids = torch.where(in_use, ids, ids[:, :1]).reshape(-1)
    k_blocks = k_cache.index_select(0, ids)
    v_blocks = v_cache.index_select(0, ids)
    span = width * block_size
    k = k_blocks.view(num_seqs, span, num_kv_heads, head_dim).transpose(1, 2).float()
    v = v_blocks.view(num_seqs, span, num_kv_heads, head_dim).transpose(1, 2).float()
    positions = first[:, None] * block_size + torch.arange(span, device=device)[None, :]
    seq_len = torch.tensor(lens, device=device)[:, None]
    mask = (positions < seq_len) & (positions > seq_len - 1 - sliding_window)
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
    o = _decode_attention_fp32(q, k, v, mask.view(num_seqs, 1, 1, span), scale, logit_softcap)
    return o.reshape(num_seqs, num_heads, head_dim).to(query.dtype)
