"""``AttentionBackend`` in plain PyTorch: runs anywhere, tuned for the CPU.

Decode sequences go through the chunked ``paged_decode`` (gathered blocks, batched
GEMMs); prefill/extend chunks one sequence at a time through ``extend_attention``.
"""

from __future__ import annotations

import torch

from loraplex.kernels.contracts import AttentionBackend
from loraplex.kernels.metadata import AttentionMetadata, first_visible_block
from loraplex.kernels.portable import cache_ops
from loraplex.kernels.portable.extend_attention import extend_attention, gather_context
from loraplex.kernels.portable.paged_decode import GatherWorkspace, paged_decode


class PortableAttentionBackend(AttentionBackend):
    """Paged attention in plain PyTorch; runs anywhere, tuned for the CPU."""

    name = "torch"

    def __init__(self) -> None:
        self._workspace = GatherWorkspace()

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        cache_ops.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        nd = meta.num_decodes
        window, cap = sliding_window or 0, logit_softcap or 0.0
        if nd > 0:
            self._decode(query[:nd], k_cache, v_cache, meta, scale, out[:nd], window, cap)
        if meta.num_seqs > nd:
            self._extend(query, k_cache, v_cache, meta, scale, out, window, cap)
        return out

    def _extend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the whole flat batch
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,  # like query; the prefill sequences' rows are written
        sliding_window: int = 0,
        logit_softcap: float = 0.0,
    ) -> None:
        """The prefill / chunked-prefill sequences (after the first ``num_decodes``), one at a time."""
        starts = meta.query_start_loc_cpu or tuple(meta.query_start_loc.tolist())
        lens = meta.seq_lens_cpu or tuple(meta.seq_lens.tolist())
        block_size = k_cache.shape[1]
        for i in range(meta.num_decodes, meta.num_seqs):
            lo, hi, ctx = starts[i], starts[i + 1], lens[i]
            first = first_visible_block(ctx - (hi - lo), sliding_window, block_size)
            k = gather_context(k_cache, meta.block_tables[i], ctx, first)
            v = gather_context(v_cache, meta.block_tables[i], ctx, first)
            out[lo:hi] = extend_attention(
                query[lo:hi],
                k,
                v,
                scale,
                key_start=first * block_size,
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )

    def _decode(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,  # [num_decodes, num_heads, head_dim], written
        sliding_window: int = 0,
        logit_softcap: float = 0.0,
    ) -> None:
        """The decode sequences (the first ``num_decodes`` of the batch)."""
        nd = query.shape[0]
        out.copy_(
            paged_decode(
                query,
                k_cache,
                v_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                scale,
                seq_lens_cpu=meta.seq_lens_cpu[:nd] or None,
                workspace=self._workspace,
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )
        )

    def copy_blocks(self, caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        cache_ops.copy_blocks(caches, src, dst)
