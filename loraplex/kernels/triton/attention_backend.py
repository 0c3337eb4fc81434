"""``AttentionBackend`` on the Triton kernels: the engine's attention path on CUDA."""

from __future__ import annotations

import torch

from loraplex.kernels.contracts import AttentionBackend
from loraplex.kernels.metadata import AttentionMetadata
from loraplex.kernels.triton import cache_ops
from loraplex.kernels.triton.extend_attention import extend_attention
from loraplex.kernels.triton.paged_decode import paged_decode


class TritonAttentionBackend(AttentionBackend):
    """Decodes through ``paged_decode`` (split-K when long), the rest through ``extend_attention``."""

    name = "triton"

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
        num_decodes = meta.num_decodes
        if num_decodes > 0:
            paged_decode(
                query[:num_decodes],
                k_cache,
                v_cache,
                meta.block_tables[:num_decodes],
                meta.seq_lens[:num_decodes],
                scale,
                max_seq_len=meta.max_seq_len,
                out=out[:num_decodes],
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )
        if num_decodes < meta.num_seqs:
            extend_attention(
                query,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                scale,
                max_query_len=meta.max_query_len,
                first_seq=num_decodes,
                out=out,
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )
        return out

    def copy_blocks(self, caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        cache_ops.copy_blocks(caches, src, dst)
