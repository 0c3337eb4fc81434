"""Sliding-window attention and logit soft-capping in every attention backend vs naive math.

The attention contract (``AttentionBackend.forward``): with ``sliding_window`` W a query at
position p sees keys p - W < k <= p (HF's convention), and with ``logit_softcap`` c the
scaled scores become c * tanh(s / c) before the mask. Blocks before a sequence's first
visible block may have been returned to the pool by the window manager: the tests put
``PAD_BLOCK_ID`` in those table entries and poison the blocks, so a kernel that reads one
fails (a bad id is reported) or gives a wrong result.

One flat batch mixes decodes (contexts shorter than, equal to and far past the window)
and prefill chunks (a fresh prompt longer than the window, a chunk after a long prefix, a
chunk straddling the window's edge), for the portable (torch) backend, the C kernels
and the Triton kernels (interpreted on machines without a GPU).
"""

from __future__ import annotations

import pytest
import torch
from support.kernels import (
    PagedContext,
    assert_close,
    attention_metadata,
    kernel_device,
    make_paged_context,
    naive_gather,
)

from loraplex.kernels.contracts import AttentionBackend
from loraplex.kernels.cpu.paged_extend import paged_extend_cpu
from loraplex.kernels.cpu.paged_extend import supports as extend_supports
from loraplex.kernels.metadata import PAD_BLOCK_ID, first_visible_block
from loraplex.kernels.portable.attention import PortableAttentionBackend

WINDOW = 32
HEAD_DIM = 32
NUM_KV_HEADS = 2
GQA = 2
# (query_len, context_len): decodes first (as the engine orders them), then prefills.
BATCH = [
    (1, 1),
    (1, WINDOW - 1),
    (1, WINDOW),
    (1, WINDOW + 1),
    (1, 3 * WINDOW + 5),
    (1, 200),
    (50, 50),  # a fresh prompt longer than the window
    (20, 60),  # a chunk after a prefix: the window's edge moves inside the chunk
    (37, 237),  # a chunk far past the window
    (3, 8),  # a short chunk inside the window
]
SETTINGS = [(WINDOW, None), (None, 30.0), (WINDOW, 20.0)]


def naive_windowed(
    query: torch.Tensor,  # [q, H, D]
    key: torch.Tensor,  # [ctx, KV, D]
    value: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:  # [q, H, D] float64
    """Per head, in float64: scores, soft cap, causal and window mask, softmax."""
    q_len, heads, _ = query.shape
    ctx, kv_heads, _ = key.shape
    group = heads // kv_heads
    q, k, v = query.double().cpu(), key.double().cpu(), value.double().cpu()
    out = torch.empty(q_len, heads, query.shape[2], dtype=torch.float64)
    rows = (ctx - q_len + torch.arange(q_len))[:, None]
    cols = torch.arange(ctx)[None, :]
    visible = cols <= rows
    if window:
        visible &= cols > rows - window
    for h in range(heads):
        scores = q[:, h] @ k[:, h // group].T * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
    return out


def _setup(
    block_size: int, dtype: torch.dtype, device: torch.device, window: int | None, seed: int
) -> tuple[torch.Tensor, PagedContext, list[int], list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    q_lens = [q for q, _ in BATCH]
    ctx_lens = [c for _, c in BATCH]
    ctx = make_paged_context(ctx_lens, block_size, NUM_KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"), gen)
    query = torch.randn(sum(q_lens), GQA * NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    # Each sequence's K/V before the window manager frees anything (the naive math reads these).
    kv = [
        (naive_gather(ctx.k_cache, ctx.block_tables[i], n), naive_gather(ctx.v_cache, ctx.block_tables[i], n))
        for i, n in enumerate(ctx_lens)
    ]
    if window:
        for i, (q_len, n) in enumerate(BATCH):
            for b in range(first_visible_block(n - q_len, window, block_size)):
                freed = int(ctx.block_tables[i, b])
                ctx.block_tables[i, b] = PAD_BLOCK_ID
                ctx.k_cache[freed] = float("nan")  # reading a freed block poisons the output
                ctx.v_cache[freed] = float("nan")
    ctx.k_cache, ctx.v_cache = ctx.k_cache.to(device), ctx.v_cache.to(device)
    ctx.block_tables = ctx.block_tables.to(device)
    return query.to(device), ctx, q_lens, ctx_lens, kv


def _expected(
    query: torch.Tensor,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    q_lens: list[int],
    window: int | None,
    cap: float | None,
) -> torch.Tensor:
    outs, start = [], 0
    for (k, v), q_len in zip(kv, q_lens, strict=True):
        outs.append(naive_windowed(query[start : start + q_len], k, v, HEAD_DIM**-0.5, window, cap))
        start += q_len
    return torch.cat(outs)


def _backend(name: str) -> AttentionBackend:
    if name == "torch":
        return PortableAttentionBackend()
    if name == "cpu":
        from loraplex.kernels.cpu.attention import CpuAttentionBackend

        backend = CpuAttentionBackend()
        backend._extend_in_c = True  # the C extend kernel on every machine (it is tested everywhere)
        return backend
    from loraplex.kernels.triton.attention_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def _check(name: str, block_size: int, dtype: torch.dtype, window: int | None, cap: float | None) -> None:
    device = kernel_device() if name == "triton" else torch.device("cpu")
    query, ctx, q_lens, ctx_lens, kv = _setup(block_size, dtype, device, window, seed=block_size + len(name))
    meta = attention_metadata(q_lens, ctx_lens, ctx.block_tables, block_size, device)
    out = _backend(name).forward(
        query, ctx.k_cache, ctx.v_cache, meta, HEAD_DIM**-0.5, sliding_window=window, logit_softcap=cap
    )
    assert_close(out, _expected(query, kv, q_lens, window, cap), dtype, f"{name} window={window} cap={cap}")


@pytest.mark.slow
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"w{s[0]}-cap{s[1]}")
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_window_and_softcap_float32(
    name: str, block_size: int, setting: tuple[int | None, float | None]
) -> None:
    _check(name, block_size, torch.float32, *setting)


@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_window_and_softcap_bfloat16(name: str) -> None:
    _check(name, 16, torch.bfloat16, WINDOW, 20.0)


@pytest.mark.parametrize("row_vectors", [1, 2, 3, 6])
def test_c_extend_window_at_every_tile_width(row_vectors: int) -> None:
    # Small windows inside wide tiles: rows that see no key of a whole chunk must stay finite.
    window = 5
    query, ctx, q_lens, ctx_lens, kv = _setup(8, torch.float32, torch.device("cpu"), window, seed=row_vectors)
    nd = sum(1 for q in q_lens if q == 1)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    assert extend_supports(query, ctx.k_cache)
    out = torch.zeros_like(query)
    paged_extend_cpu(
        query,
        ctx.k_cache,
        ctx.v_cache,
        ctx.block_tables[nd:],
        torch.tensor(ctx_lens[nd:], dtype=torch.int32),
        torch.tensor(starts[nd:], dtype=torch.int32),
        HEAD_DIM**-0.5,
        out=out,
        max_row_vectors=row_vectors,
        sliding_window=window,
        logit_softcap=None,
    )
    lo = starts[nd]
    expected = _expected(query, kv, q_lens, window, None)[lo:]
    assert_close(out[lo:], expected, torch.float32, f"C extend, window {window}, {row_vectors} row vectors")


def test_freed_block_inside_the_window_is_reported() -> None:
    # The kernels trust the window, not the table: a PAD entry the window needs is an error.
    for name in ("torch", "cpu"):
        query, ctx, q_lens, ctx_lens, _ = _setup(8, torch.float32, torch.device("cpu"), WINDOW, seed=1)
        row = len(BATCH) - 2  # (37, 237): its first visible block is well inside the table
        first = first_visible_block(ctx_lens[row] - q_lens[row], WINDOW, 8)
        ctx.block_tables[row, first] = PAD_BLOCK_ID
        meta = attention_metadata(q_lens, ctx_lens, ctx.block_tables, 8, torch.device("cpu"))
        with pytest.raises(ValueError):
            _backend(name).forward(
                query, ctx.k_cache, ctx.v_cache, meta, HEAD_DIM**-0.5, sliding_window=WINDOW
            )
