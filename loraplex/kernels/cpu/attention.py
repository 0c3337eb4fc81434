"""The CPU attention backend: the C paged decode kernel, the portable backend for everything else.

Decode attention is most of the attention time of a serving step (every running
sequence reads its whole context every step), so it gets the compiled kernel;
prefill/extend chunks are few per step and long, where torch's SDPA is already
efficient. Shapes or dtypes the kernel does not take (float16, very wide GQA
groups) fall back to the portable path per call.
"""

from __future__ import annotations

import torch

from loraplex.kernels.cpu.paged_decode import paged_decode_cpu, supports
from loraplex.kernels.metadata import AttentionMetadata
from loraplex.kernels.portable.attention import PortableAttentionBackend


class CpuAttentionBackend(PortableAttentionBackend):
    """Portable attention with decode served by the compiled C kernel (CPU only)."""

    name = "cpu"

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        if not supports(query, k_cache):
            super()._decode(query, k_cache, v_cache, meta, scale, out)
            return
        nd = query.shape[0]
        result = paged_decode_cpu(
            query,
            k_cache,
            v_cache,
            meta.block_tables[:nd],
            meta.seq_lens[:nd],
            scale,
            out=out if out.is_contiguous() else None,
        )
        if result is not out:
            out.copy_(result)
