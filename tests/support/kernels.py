"""Naive math and random data for the kernel tests, references no backend runs, packed weights.

Everything here is written the slow, obvious way (per-position index arithmetic,
per-head and per-token loops, float64) and shares no code with the kernels or the
torch backends, so a test comparing against it can fail.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.kernels.contracts import PackedWeight
from loraplex.kernels.formats import FORMATS
from loraplex.kernels.metadata import PAD_BLOCK_ID, AttentionMetadata

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# (atol, rtol) of a kernel's output against float64 math on the same rounded inputs.
# fp32: exact-fp32 dots ("ieee"), only summation order differs. fp16/bf16: the
# softmax probabilities (attention) or the rank vector (LoRA expand) are rounded to
# the input dtype before the second product, and outputs are stored in that dtype.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 4e-3),
    torch.bfloat16: (1.6e-2, 3e-2),
}


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def kernel_device() -> torch.device:
    """CUDA when kernels run compiled, else the CPU (interpreter / torch path)."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return torch.device("cuda" if torch.cuda.is_available() and not interpreting else "cpu")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Compare ``actual`` to float64 ``expected`` within ``dtype``'s stated tolerance."""
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(
        actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


# -- attention ------------------------------------------------------------------------


@dataclass
class PagedContext:
    """Random paged KV for a batch of sequences, with shuffled, non-contiguous blocks."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, PAD_BLOCK_ID-padded
    seq_lens: list[int]


def make_paged_context(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
) -> PagedContext:
    """Caches holding every sequence's context, blocks scattered in a random order."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks nobody owns: reading one is a bug
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq)
    table = torch.full((len(seq_lens), width), PAD_BLOCK_ID, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = torch.tensor(order[used : used + n], dtype=torch.int32)
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    # Poison the unowned blocks so reading past a sequence's blocks shows up.
    for b in order[used:]:
        k_cache[b] = 1e4
        v_cache[b] = 1e4
    return PagedContext(k_cache.to(device), v_cache.to(device), table.to(device), list(seq_lens))


def naive_gather(cache: torch.Tensor, table_row: torch.Tensor, context_len: int) -> torch.Tensor:
    """``[context_len, num_kv_heads, head_dim]``: position t lives at block table[t // B], row t % B."""
    block_size = cache.shape[1]
    rows = []
    for t in range(context_len):
        rows.append(cache[int(table_row[t // block_size]), t % block_size])
    return torch.stack(rows)


def naive_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:  # [query_len, num_heads, head_dim] float64
    """softmax(q K^T * scale) V per head, causal with the queries at the context's end."""
    query_len, num_heads, _ = query.shape
    context_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    prefix = context_len - query_len
    q, k, v = query.double().cpu(), key.double().cpu(), value.double().cpu()
    out = torch.empty(query_len, num_heads, query.shape[2], dtype=torch.float64)
    for h in range(num_heads):
        scores = q[:, h] @ k[:, h // group].T * scale  # [query_len, context_len]
        visible = torch.arange(context_len)[None, :] <= (prefix + torch.arange(query_len))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
    return out


def naive_paged_decode(query: torch.Tensor, ctx: PagedContext, scale: float) -> torch.Tensor:
    """Decode attention of ``query [num_seqs, H, D]`` computed sequence by sequence."""
    outs = []
    for i, n in enumerate(ctx.seq_lens):
        k = naive_gather(ctx.k_cache, ctx.block_tables[i], n)
        v = naive_gather(ctx.v_cache, ctx.block_tables[i], n)
        outs.append(naive_attention(query[i : i + 1], k, v, scale)[0])
    return torch.stack(outs)


def naive_paged_extend(
    query: torch.Tensor, ctx: PagedContext, query_lens: list[int], contexts: list[int], scale: float
) -> torch.Tensor:
    """Prefill attention: each sequence's ``query_lens[i]`` new rows (consecutive in ``query``)
    over its ``contexts[i]`` cached positions, causal at the context's end (float64)."""
    outs, start = [], 0
    for i, (q_len, c_len) in enumerate(zip(query_lens, contexts, strict=True)):
        k = naive_gather(ctx.k_cache, ctx.block_tables[i], c_len)
        v = naive_gather(ctx.v_cache, ctx.block_tables[i], c_len)
        outs.append(naive_attention(query[start : start + q_len], k, v, scale))
        start += q_len
    return torch.cat(outs)


def attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Flat-batch metadata; decodes (query_len 1) must come first, as the engine orders them."""
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    assert all(n > 1 for n in query_lens[num_decodes:]), "decodes must come first"
    starts = [0]
    slots: list[int] = []
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        starts.append(starts[-1] + q_len)
        for pos in range(s_len - q_len, s_len):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=tuple(starts),
        seq_lens_cpu=tuple(seq_lens),
    )


# -- LoRA -------------------------------------------------------------------------------


@dataclass
class LoRAWeights:
    """Stacked, rank-padded adapters in the ``LoRABackend`` layout."""

    lora_a: torch.Tensor  # [num_slices, max_loras, max_rank, in_features]
    lora_b: torch.Tensor  # [num_slices, max_loras, max_out, max_rank]
    scales: torch.Tensor  # [max_loras] float32
    slice_sizes: tuple[int, ...]
    ranks: list[int]


def make_lora_weights(
    in_features: int,
    slice_sizes: tuple[int, ...],
    ranks: list[int],
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
) -> LoRAWeights:
    """One adapter per slot with rank ``ranks[slot]``; rows/cols past the rank are zero."""
    max_rank = max(ranks)
    num_slices, max_loras, max_out = len(slice_sizes), len(ranks), max(slice_sizes)
    lora_a = torch.zeros(num_slices, max_loras, max_rank, in_features)
    lora_b = torch.zeros(num_slices, max_loras, max_out, max_rank)
    for slot, rank in enumerate(ranks):
        for s, size in enumerate(slice_sizes):
            lora_a[s, slot, :rank] = torch.randn(rank, in_features, generator=gen) / in_features**0.5
            lora_b[s, slot, :size, :rank] = torch.randn(size, rank, generator=gen) / rank**0.5
    scales = torch.rand(max_loras, generator=gen) + 0.5
    return LoRAWeights(
        lora_a.to(dtype).to(device), lora_b.to(dtype).to(device), scales.to(device), slice_sizes, ranks
    )


def naive_lora_shrink(x: torch.Tensor, w: LoRAWeights, token_slots: list[int]) -> torch.Tensor:
    """``[num_slices, num_tokens, max_rank]`` float64, token by token."""
    num_slices, _, max_rank, _ = w.lora_a.shape
    out = torch.zeros(num_slices, x.shape[0], max_rank, dtype=torch.float64)
    a = w.lora_a.double().cpu()
    xd = x.double().cpu()
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for s in range(num_slices):
            out[s, t] = a[s, slot] @ xd[t]
    return out


def naive_lora_delta(x: torch.Tensor, w: LoRAWeights, token_slots: list[int]) -> torch.Tensor:
    """``[num_tokens, sum(slice_sizes)]`` float64: scale * x @ (A^T B^T), token by token."""
    a, b = w.lora_a.double().cpu(), w.lora_b.double().cpu()
    xd = x.double().cpu()
    out = torch.zeros(x.shape[0], sum(w.slice_sizes), dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        col = 0
        for s, size in enumerate(w.slice_sizes):
            out[t, col : col + size] = float(w.scales[slot]) * (xd[t] @ a[s, slot].T @ b[s, slot, :size].T)
            col += size
    return out


# References only the kernel tests and benchmarks use. What the portable backend runs lives in
# ``loraplex/kernels/portable`` and serves as the Triton kernels' reference from there; this
# part holds only what no backend calls.


def swap_blocks(
    src_cache: torch.Tensor,  # [num_src_blocks, block_size, num_kv_heads, head_dim]
    dst_cache: torch.Tensor,  # [num_dst_blocks, block_size, num_kv_heads, head_dim]
    src_ids: torch.Tensor,  # [num_pairs] int64, on src_cache's device
    dst_ids: torch.Tensor,  # [num_pairs] int64, on dst_cache's device
) -> None:
    """``dst_cache[dst_ids[i]] = src_cache[src_ids[i]]`` across pools, possibly across devices.

    The reference of ``triton.cache_ops.copy_blocks_between`` (which stays on one device).
    One gather on the source device, one transfer, one scatter on the destination
    device. Only host-to-GPU transfers are non-blocking: a non-blocking GPU-to-host
    copy could be read by the host-side scatter before it lands.
    """
    if src_ids.numel() == 0:
        return
    assert src_cache.shape[1:] == dst_cache.shape[1:], "pools hold differently shaped blocks"
    assert src_ids.shape == dst_ids.shape, "src_ids and dst_ids differ in length"
    blocks = src_cache.index_select(0, src_ids.to(src_cache.device, torch.int64))
    blocks = blocks.to(dst_cache.device, dst_cache.dtype, non_blocking=dst_cache.device.type == "cuda")
    dst_cache.index_copy_(0, dst_ids.to(dst_cache.device, torch.int64), blocks)


# Packed weights for the quantized-kernel tests: random but well-formed blocks of every format.

# Byte offsets of the float16 fields of each block format (set to sane values in random blocks).
F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q6_k": (208,)}


def random_packed(name: str, rows: int, in_features: int, gen: torch.Generator) -> PackedWeight:
    """A ``rows x in_features`` weight in format ``name``: quantized from Gaussian floats where
    the format quantizes, else random bytes with small float16 scales."""
    fmt = FORMATS[name]  # type: ignore[index]
    w = torch.randn(rows, in_features, generator=gen) * 0.05
    if name not in ("q4_k", "q6_k"):
        return PackedWeight(fmt, fmt.quantize(w), in_features)
    data = torch.randint(0, 256, (rows, fmt.row_bytes(in_features)), generator=gen, dtype=torch.uint8)
    blocks = data.view(-1, fmt.block_bytes)
    for offset in F16_FIELDS[name]:
        scale = (torch.rand(blocks.shape[0], 1, generator=gen) * 0.01 + 1e-3).half()
        blocks[:, offset : offset + 2] = scale.view(torch.uint8)
    return PackedWeight(fmt, data, in_features)
