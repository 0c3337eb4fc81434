"""The CPU attention backend: the C paged decode and extend kernels, the portable backend for the rest.

Decode attention is most of the attention time of a serving step (every running
sequence reads its whole context every step), and prefill chunks over a long cached
prefix (prefix-cache hits, later chunks of a long prompt) read that whole prefix for
every new token: both get compiled kernels that read K/V in place through the block
table. Shapes or dtypes the kernels do not take (float16, very wide GQA groups, odd
head dims) fall back to the portable path per call.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from loraplex.kernels.cpu import paged_decode, paged_extend
from loraplex.kernels.cpu.build import bind
from loraplex.kernels.metadata import AttentionMetadata
from loraplex.kernels.portable.attention import PortableAttentionBackend

_KV_WRITE = (
    "loraplex_kv_write",
    (*[ctypes.c_void_p, ctypes.c_int64] * 2, *[ctypes.c_void_p] * 3, *[ctypes.c_int64] * 3),
)


def kv_write_kernel() -> Any | None:
    """The bound C KV write (``loraplex_kv_write``: rows copied to slots as bytes), or None."""
    return bind(*_KV_WRITE)


def _token_rows(t: torch.Tensor) -> bool:
    """[num_tokens, num_kv_heads, head_dim] with each token's heads contiguous (any token stride)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


class CpuAttentionBackend(PortableAttentionBackend):
    """Portable attention with decode and prefill served by compiled C kernels (CPU only)."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self._extend_in_c = paged_extend.worth_it()

    @property
    def extend_in_c(self) -> bool:
        """Whether prefill chunks go to the C extend kernel (the library has tiles for this CPU)."""
        return self._extend_in_c

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        kernel = kv_write_kernel()
        if (
            kernel is None
            or key.dtype != k_cache.dtype
            or value.dtype != v_cache.dtype
            or not (_token_rows(key) and _token_rows(value))
            or key.shape[1:] != k_cache.shape[2:]
            or value.shape != key.shape
            or slot_mapping.dtype != torch.int64
            or not (slot_mapping.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous())
        ):
            super().write_kv(key, value, k_cache, v_cache, slot_mapping)
            return
        elem = key.element_size()
        row_bytes = k_cache.shape[2] * k_cache.shape[3] * elem
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        bad = kernel(
            key.data_ptr(),
            key.stride(0) * elem,
            value.data_ptr(),
            value.stride(0) * elem,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slot_mapping.data_ptr(),
            key.shape[0],
            row_bytes,
            num_slots,
        )
        if bad:
            raise IndexError(f"{bad} KV slots outside the cache's {num_slots} slots")

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        sliding_window: int = 0,
        logit_softcap: float = 0.0,
    ) -> None:
        if not paged_decode.supports(query, k_cache):
            super()._decode(query, k_cache, v_cache, meta, scale, out, sliding_window, logit_softcap)
            return
        nd = query.shape[0]
        result = paged_decode.paged_decode_cpu(
            query,
            k_cache,
            v_cache,
            meta.block_tables[:nd],
            meta.seq_lens[:nd],
            scale,
            out=out if out.is_contiguous() else None,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )
        if result is not out:
            out.copy_(result)

    def _extend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        sliding_window: int = 0,
        logit_softcap: float = 0.0,
    ) -> None:
        if not (self._extend_in_c and paged_extend.supports(query, k_cache)):
            super()._extend(query, k_cache, v_cache, meta, scale, out, sliding_window, logit_softcap)
            return
        nd = meta.num_decodes
        # One call for every prefill sequence of the step; query_start keeps the flat
        # batch's offsets (the kernel indexes query and out with them directly).
        paged_extend.paged_extend_cpu(
            query,
            k_cache,
            v_cache,
            meta.block_tables[nd:],
            meta.seq_lens[nd:],
            meta.query_start_loc[nd:],
            scale,
            out=out,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )
