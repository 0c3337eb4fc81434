"""Attention backends end to end (write_kv, then forward on a flat mixed batch) and the registry.

Both backends run the same step the engine runs: new tokens' K/V are written into
the paged cache through ``slot_mapping``, then decodes and prefill/extend chunks
attend over their contexts in one ``forward``. The expectation is naive float64
attention over each sequence's context gathered position by position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from support.kernels import (
    DTYPES,
    PagedContext,
    assert_close,
    attention_metadata,
    kernel_device,
    make_paged_context,
    naive_attention,
    naive_gather,
)

from loraplex.kernels.contracts import AttentionBackend
from loraplex.kernels.cpu.attention import CpuAttentionBackend
from loraplex.kernels.cpu.lora import CpuLoRABackend
from loraplex.kernels.metadata import PAD_BLOCK_ID, AttentionMetadata
from loraplex.kernels.portable.attention import PortableAttentionBackend
from loraplex.kernels.portable.lora import PortableLoRABackend
from loraplex.kernels.registry import select_attention_backend, select_lora_backend
from loraplex.kernels.triton.attention_backend import TritonAttentionBackend
from loraplex.kernels.triton.lora_backend import TritonLoRABackend

DEVICE = kernel_device()

# (cached prefix, new tokens) per sequence: decodes first, as the engine orders them.
STEP = [(0, 1), (15, 1), (16, 1), (1029, 1), (0, 18), (16, 3), (21, 40)]


def _run_step(
    backend: AttentionBackend,
    dtype: torch.dtype,
    block_size: int,
    num_heads: int,
    device: torch.device = DEVICE,
) -> None:
    num_kv_heads, head_dim = 1 if num_heads == 3 else 2, 64
    gen = torch.Generator().manual_seed(block_size + num_heads)
    seq_lens = [p + n for p, n in STEP]
    query_lens = [n for _, n in STEP]
    ctx = make_paged_context(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
    meta = attention_metadata(query_lens, seq_lens, ctx.block_tables, block_size, device)
    num_tokens = sum(query_lens)
    # The new tokens' K/V replace whatever the cache held at their slots.
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(device)
    k_cache, v_cache = ctx.k_cache.clone(), ctx.v_cache.clone()

    backend.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    out = backend.forward(query, k_cache, v_cache, meta, head_dim**-0.5)

    start = 0
    for i, (prefix, n) in enumerate(STEP):
        k = naive_gather(ctx.k_cache, ctx.block_tables[i], prefix + n)
        v = naive_gather(ctx.v_cache, ctx.block_tables[i], prefix + n)
        k[prefix:], v[prefix:] = key[start : start + n], value[start : start + n]
        expected = naive_attention(query[start : start + n], k, v, head_dim**-0.5)
        assert_close(
            out[start : start + n], expected, dtype, f"{backend.name} seq {i} (prefix {prefix}, {n} new)"
        )
        start += n


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("block_size,num_heads", [(8, 3), (16, 8), (32, 2)])
def test_portable_attention_backend(dtype: torch.dtype, block_size: int, num_heads: int) -> None:
    _run_step(PortableAttentionBackend(), dtype, block_size, num_heads)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("block_size,num_heads", [(8, 3), (16, 8)])
def test_cpu_attention_backend(dtype: torch.dtype, block_size: int, num_heads: int) -> None:
    """C decode kernel for float32/bfloat16 decodes, torch for float16 and for the chunks.
    On the CPU on every machine: the C kernels take CPU tensors."""
    _run_step(CpuAttentionBackend(), dtype, block_size, num_heads, torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_triton_attention_backend(dtype: torch.dtype) -> None:
    _run_step(TritonAttentionBackend(), dtype, block_size=16, num_heads=8)


def test_portable_attention_backend_copy_blocks() -> None:
    caches = [torch.arange(4 * 2 * 1 * 4, dtype=torch.float32).view(4, 2, 1, 4) + 100 * i for i in range(2)]
    before = [c.clone() for c in caches]
    PortableAttentionBackend().copy_blocks(caches, torch.tensor([3, 0]), torch.tensor([1, 2]))
    for cache, old in zip(caches, before, strict=True):
        assert torch.equal(cache[1], old[3]) and torch.equal(cache[2], old[0])
        assert torch.equal(cache[0], old[0]) and torch.equal(cache[3], old[3])


def test_registry_picks_by_device_and_override() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert isinstance(select_attention_backend("auto", cpu), CpuAttentionBackend)  # when a compiler exists
    assert isinstance(select_attention_backend("auto", cuda), TritonAttentionBackend)
    assert isinstance(select_attention_backend("triton", cpu), TritonAttentionBackend)
    assert type(select_attention_backend("torch", cuda)) is PortableAttentionBackend
    assert isinstance(select_lora_backend("auto", cpu), CpuLoRABackend)  # when a compiler exists
    assert type(select_lora_backend("torch", cpu)) is PortableLoRABackend
    assert isinstance(select_lora_backend("auto", cuda), TritonLoRABackend)
    with pytest.raises(ValueError, match="unknown LoRA backend 'cutlass'; choose one of 'auto', 'torch', "):
        select_lora_backend("cutlass", cpu)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        select_attention_backend("cuda", cpu)  # type: ignore[arg-type]


# -- block-table padding -------------------------------------------------------------------

# Small enough for the interpreter; decodes of 1, 21 and 41 tokens (1, 3 and 6 blocks of 8)
# and two chunks, so every row but the longest is padded.
PAD_STEP = [(0, 1), (20, 1), (40, 1), (0, 18), (16, 3)]
PAD_BLOCK_SIZE = 8
PAD_BACKENDS: dict[str, tuple[Callable[[], AttentionBackend], torch.device]] = {
    "portable": (PortableAttentionBackend, DEVICE),
    "cpu": (CpuAttentionBackend, torch.device("cpu")),
    "triton": (TritonAttentionBackend, DEVICE),
}


def _pad_step(device: torch.device) -> tuple[PagedContext, AttentionMetadata, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    seq_lens = [p + n for p, n in PAD_STEP]
    query_lens = [n for _, n in PAD_STEP]
    ctx = make_paged_context(seq_lens, PAD_BLOCK_SIZE, 1, 64, torch.float32, device, gen)
    meta = attention_metadata(query_lens, seq_lens, ctx.block_tables, PAD_BLOCK_SIZE, device)
    query = torch.randn(sum(query_lens), 2, 64, generator=gen).to(device)
    return ctx, meta, query


@pytest.mark.parametrize("backend_name", list(PAD_BACKENDS))
def test_pad_block_id_padding_gives_identical_results(backend_name: str) -> None:
    """Padding is never read: a PAD_BLOCK_ID-padded table and a 0-padded one give equal bits."""
    make_backend, device = PAD_BACKENDS[backend_name]
    ctx, meta, query = _pad_step(device)
    assert int((meta.block_tables == PAD_BLOCK_ID).sum()) == 14  # 5 + 3 + 0 + 3 + 3 padded entries
    zero_padded = dataclasses.replace(meta, block_tables=meta.block_tables.clamp(min=0))
    backend = make_backend()
    out_pad = backend.forward(query, ctx.k_cache, ctx.v_cache, meta, 0.125)
    out_zero = backend.forward(query, ctx.k_cache, ctx.v_cache, zero_padded, 0.125)
    assert torch.equal(out_pad, out_zero)
    start = 0
    for i, (prefix, n) in enumerate(PAD_STEP):
        k = naive_gather(ctx.k_cache, ctx.block_tables[i], prefix + n)
        v = naive_gather(ctx.v_cache, ctx.block_tables[i], prefix + n)
        expected = naive_attention(query[start : start + n], k, v, 0.125)
        assert_close(out_pad[start : start + n], expected, torch.float32, f"{backend_name} seq {i}")
        start += n


@pytest.mark.parametrize("backend_name", list(PAD_BACKENDS))
@pytest.mark.parametrize(
    ("seq", "entry"),
    [(1, 2), (2, 0), (3, 1), (4, 2)],
    ids=["decode-last", "decode-first", "chunk", "chunk-last"],
)
def test_pad_block_id_inside_used_range_raises(backend_name: str, seq: int, entry: int) -> None:
    """A used block-table entry set to PAD_BLOCK_ID is an error, never a read of block -1 (or 0)."""
    make_backend, device = PAD_BACKENDS[backend_name]
    ctx, meta, query = _pad_step(device)
    table = meta.block_tables.clone()
    table[seq, entry] = PAD_BLOCK_ID
    with pytest.raises(ValueError, match="PAD_BLOCK_ID"):
        make_backend().forward(
            query, ctx.k_cache, ctx.v_cache, dataclasses.replace(meta, block_tables=table), 0.125
        )
