"""GPU check of the Triton kernels: correctness on CUDA, then bandwidth and LoRA timings.

Run on one GPU (sized for an H200; about 3-5 minutes, well under 8)::

    python benchmarks/gpu_kernels.py                  # correctness + timings
    python benchmarks/gpu_kernels.py --skip-timing    # correctness only
    python benchmarks/gpu_kernels.py --cpu-smoke      # tiny sizes, CPU, TRITON_INTERPRET=1

1. Correctness, bf16 and fp16 (bf16 only in --cpu-smoke): every Triton kernel (paged decode plain and split-K,
   extend attention, write_kv, copy_blocks, copy_blocks_between, BGMV/SGMV shrink and
   expand, both backends, ``apply_paged`` over mixed-rank pages) against its portable
   (torch) reference on the same device.
2. Decode attention: achieved bandwidth (K/V bytes read / time) as a percentage of a
   measured device-to-device copy, batch 1/16/64 x context 512/4k/32k, Llama-3-8B
   heads (32 query / 8 KV, head_dim 128, bf16, block 16); the split-K heuristic's
   choice next to no split; the same attention over contiguous K/V with
   ``F.scaled_dot_product_attention``.
3. LoRA: ``TritonLoRABackend.apply`` (shrink + expand, rank 16, fused q/k/v of
   Llama-3-8B) vs the base projection's matmul, for 1/16/64 distinct adapters, on a
   decode batch (64 tokens) and a prefill batch (4096 tokens); then paged adapters
   (pages of 8 rows, 16 adapters of ranks 8-64, so up to 8 page passes):
   ``apply_paged`` with every pass in one launch pair per kernel family vs the per-pass loop.

``--cpu-smoke`` runs section 1 at tiny sizes and sections 2-3 at toy sizes on the CPU
(timings meaningless), so every code path of this script is exercised without a GPU.
Prints tables; writes ``gpu_kernels.json`` (``gpu_kernels_cpu_smoke.json``) under
``--out``. Exit status 1 if any correctness check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# --cpu-smoke must switch Triton to the interpreter before any kernel module is
# imported (the @triton.jit decorator decides at import time).
if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

from loraplex.kernels.contracts import LoRABackend
from loraplex.kernels.metadata import PAD_BLOCK_ID, AttentionMetadata, LoRAMetadata
from loraplex.kernels.portable import cache_ops as portable_cache_ops
from loraplex.kernels.portable import extend_attention as portable_extend
from loraplex.kernels.portable import paged_decode as portable_decode
from loraplex.kernels.portable.attention import PortableAttentionBackend
from loraplex.kernels.portable.lora import PortableLoRABackend
from loraplex.kernels.triton import cache_ops
from loraplex.kernels.triton.attention_backend import TritonAttentionBackend
from loraplex.kernels.triton.extend_attention import extend_attention
from loraplex.kernels.triton.lora_backend import TritonLoRABackend
from loraplex.kernels.triton.lora_expand import bgmv_expand, sgmv_expand
from loraplex.kernels.triton.lora_shrink import bgmv_shrink, sgmv_shrink
from loraplex.kernels.triton.paged_decode import choose_num_splits, paged_decode

# (atol, rtol) of Triton vs the portable reference, both on the device, per dtype.
TOLERANCES = {torch.bfloat16: (3e-2, 3e-2), torch.float16: (4e-3, 5e-3)}


# -- timing -------------------------------------------------------------------------------


class Timer:
    """Median milliseconds of a function: CUDA events (L2 flushed before each run) or wall clock."""

    def __init__(self, device: torch.device, warmup: int, repeats: int) -> None:
        self.device = device
        self.warmup = warmup
        self.repeats = repeats
        # Writing 256 MiB evicts the 50-60 MiB L2, so small K/V are not read from cache.
        self._flush = (
            torch.empty(64 << 20, dtype=torch.int32, device=device) if device.type == "cuda" else None
        )

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        samples: list[float] = []
        for _ in range(self.repeats):
            if self._flush is not None:
                self._flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)


# -- correctness --------------------------------------------------------------------------


def _paged_cache(
    lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and shuffled, ``PAD_BLOCK_ID``-padded block tables holding ``lens`` tokens."""
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 2
    order = torch.randperm(num_blocks)
    table = torch.full((len(lens), max(per_seq)), PAD_BLOCK_ID, dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        table[i, :n] = order[used : used + n].to(torch.int32)
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, device=device).to(dtype)
    v = torch.randn(shape, device=device).to(dtype)
    return k, v, table.to(device)


class Checks:
    """Collects (name, dtype, max error, passed) for every comparison."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def close(self, name: str, dtype: torch.dtype, actual: torch.Tensor, expected: torch.Tensor) -> None:
        atol, rtol = TOLERANCES[dtype]
        a, e = actual.float(), expected.float()
        err = (a - e).abs()
        ok = bool((err <= atol + rtol * e.abs()).all()) and bool(torch.isfinite(a).all())
        self.rows.append(
            {
                "check": name,
                "dtype": str(dtype).removeprefix("torch."),
                "max_abs_err": err.max().item(),
                "ok": ok,
            }
        )

    def equal(self, name: str, dtype: torch.dtype, actual: torch.Tensor, expected: torch.Tensor) -> None:
        ok = torch.equal(actual, expected)
        self.rows.append(
            {
                "check": name,
                "dtype": str(dtype).removeprefix("torch."),
                "max_abs_err": 0.0 if ok else float("nan"),
                "ok": ok,
            }
        )


def check_attention(checks: Checks, dtype: torch.dtype, device: torch.device, tiny: bool) -> None:
    heads = [(4, 2, 64)] if tiny else [(32, 8, 128), (9, 3, 64)]
    long_len = 70 if tiny else 1500
    for num_heads, kv_heads, head_dim in heads:
        tag = f"H{num_heads}/{kv_heads} D{head_dim}"
        for block_size in (16,) if tiny else (16, 32):
            lens = [1, block_size, block_size + 1, 3 * block_size - 2, long_len]
            k_cache, v_cache, table = _paged_cache(lens, block_size, kv_heads, head_dim, dtype, device)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
            q = torch.randn(len(lens), num_heads, head_dim, device=device).to(dtype)
            scale = head_dim**-0.5
            ref = portable_decode.paged_decode(q, k_cache, v_cache, table, seq_lens, scale)
            for splits in (None, 4) if tiny else (None, 1, 4):  # None: the heuristic (1 on a CPU)
                out = paged_decode(q, k_cache, v_cache, table, seq_lens, scale, max(lens), num_splits=splits)
                checks.close(f"paged_decode splits={splits} bs{block_size} {tag}", dtype, out, ref)

            chunks = [(0, 1), (0, 17), (block_size, 5), (block_size + 3, 20), (0, 70), (long_len, 24)]
            ctx = [p + n for p, n in chunks]
            k_cache, v_cache, table = _paged_cache(ctx, block_size, kv_heads, head_dim, dtype, device)
            starts = [0]
            for _, n in chunks:
                starts.append(starts[-1] + n)
            q = torch.randn(starts[-1], num_heads, head_dim, device=device).to(dtype)
            out = extend_attention(
                q, k_cache, v_cache, table,
                torch.tensor(starts, dtype=torch.int32, device=device),
                torch.tensor(ctx, dtype=torch.int32, device=device),
                scale, max_query_len=max(n for _, n in chunks),
            )  # fmt: skip
            refs = []
            for i, n in enumerate(ctx):
                k = portable_extend.gather_context(k_cache, table[i], n)
                v = portable_extend.gather_context(v_cache, table[i], n)
                refs.append(portable_extend.extend_attention(q[starts[i] : starts[i + 1]], k, v, scale))
            checks.close(f"extend_attention bs{block_size} {tag}", dtype, out, torch.cat(refs))

    # Both backends on one engine-like step: write_kv, then decodes + extends together.
    num_heads, kv_heads, head_dim, block_size = (4, 2, 64, 16) if tiny else (32, 8, 128, 16)
    step = [(0, 1), (40, 1), (long_len, 1), (0, 33), (block_size + 1, 9)]
    ctx = [p + n for p, n in step]
    k_cache, v_cache, table = _paged_cache(ctx, block_size, kv_heads, head_dim, dtype, device)
    starts, slots = [0], []
    for i, (p, n) in enumerate(step):
        starts.append(starts[-1] + n)
        slots += [int(table[i, t // block_size]) * block_size + t % block_size for t in range(p, p + n)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        block_tables=table,
        num_decodes=3,
        max_query_len=33,
        max_seq_len=max(ctx),
        query_start_loc_cpu=tuple(starts),
        seq_lens_cpu=tuple(ctx),
    )
    num_tokens = starts[-1]
    q = torch.randn(num_tokens, num_heads, head_dim, device=device).to(dtype)
    key = torch.randn(num_tokens, kv_heads, head_dim, device=device).to(dtype)
    value = torch.randn(num_tokens, kv_heads, head_dim, device=device).to(dtype)
    outs = []
    for backend in (TritonAttentionBackend(), PortableAttentionBackend()):
        kc, vc = k_cache.clone(), v_cache.clone()
        backend.write_kv(key, value, kc, vc, meta.slot_mapping)
        outs.append((kc, vc, backend.forward(q, kc, vc, meta, head_dim**-0.5)))
    checks.equal("write_kv (backend) K cache", dtype, outs[0][0], outs[1][0])
    checks.equal("write_kv (backend) V cache", dtype, outs[0][1], outs[1][1])
    checks.close("TritonAttentionBackend.forward mixed step", dtype, outs[0][2], outs[1][2])


def check_cache_ops(checks: Checks, dtype: torch.dtype, device: torch.device) -> None:
    k_cache = torch.randn(12, 16, 3, 64, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    key = torch.randn(6, 3, 64, device=device).to(dtype)
    value = torch.randn_like(key)
    slots = torch.tensor([0, 17, -1, 40, 191, 5], dtype=torch.int64, device=device)
    kt, vt, kr, vr = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    cache_ops.write_kv(key, value, kt, vt, slots)
    portable_cache_ops.write_kv(key, value, kr, vr, slots)
    checks.equal("write_kv", dtype, torch.stack([kt, vt]), torch.stack([kr, vr]))

    src = torch.tensor([1, 4, 9], device=device)
    dst = torch.tensor([0, 7, 11], device=device)
    triton_caches = [k_cache.clone(), v_cache.clone()]
    ref_caches = [k_cache.clone(), v_cache.clone()]
    cache_ops.copy_blocks(triton_caches, src, dst)
    portable_cache_ops.copy_blocks(ref_caches, src, dst)
    checks.equal("copy_blocks", dtype, torch.stack(triton_caches), torch.stack(ref_caches))

    staging = torch.zeros(4, 16, 3, 64, dtype=dtype, device=device)
    cache_ops.copy_blocks_between(k_cache, staging, src, torch.tensor([3, 0, 2], device=device))
    expected = torch.zeros_like(staging)
    expected[[3, 0, 2]] = k_cache[src]
    checks.equal("copy_blocks_between", dtype, staging, expected)


def check_lora(checks: Checks, dtype: torch.dtype, device: torch.device, tiny: bool) -> None:
    in_features = 96 if tiny else 4096
    slice_sizes = (48, 16, 16) if tiny else (4096, 1024, 1024)
    ranks = [8, 64, 16, 8]
    num_slices, max_rank = len(slice_sizes), max(ranks)
    lora_a = torch.zeros(num_slices, len(ranks), max_rank, in_features, device=device)
    lora_b = torch.zeros(num_slices, len(ranks), max(slice_sizes), max_rank, device=device)
    for slot, rank in enumerate(ranks):
        lora_a[:, slot, :rank] = torch.randn(num_slices, rank, in_features, device=device) / in_features**0.5
        lora_b[:, slot, :, :rank] = torch.randn(num_slices, max(slice_sizes), rank, device=device) / rank**0.5
    lora_a, lora_b = lora_a.to(dtype), lora_b.to(dtype)
    scales = torch.rand(len(ranks), device=device) + 0.5
    # Interleaved and repeated slots, base-only tokens, runs long enough for SGMV (>= 16).
    if tiny:
        decode, prefill = [0, 2, -1, 1, 0], [1] * 16 + [-1] * 2 + [0] * 3 + [2] * 16
    else:
        decode = [0, 2, -1, 1, 0, 0, 2, -1, 1, 2, 0]
        prefill = [1] * 20 + [-1] * 5 + [0] * 17 + [2] * 3 + [0] * 18 + [1] * 2
    for name, token_slots in (("decode", decode), ("prefill", prefill), ("mixed", decode + prefill)):
        meta = LoRAMetadata.from_token_slots(token_slots, device)
        x = torch.randn(len(token_slots), in_features, device=device).to(dtype)
        y = torch.randn(len(token_slots), sum(slice_sizes), device=device).to(dtype)
        torch_backend = PortableLoRABackend()
        ref_rank = torch_backend.shrink(x, lora_a, meta)
        max_seg = max(b - a for a, b in zip(meta.seg_starts_cpu, meta.seg_starts_cpu[1:], strict=False))
        checks.close(f"bgmv_shrink {name}", dtype, bgmv_shrink(x, lora_a, meta.token_slots), ref_rank)
        checks.close(
            f"bgmv_shrink split_k=3 {name}",
            dtype,
            bgmv_shrink(x, lora_a, meta.token_slots, split_k=3),
            ref_rank,
        )
        sg = sgmv_shrink(x, lora_a, meta.seg_starts, meta.seg_slots, max_seg)
        checks.close(f"sgmv_shrink {name}", dtype, sg, ref_rank)
        ref_y = y.clone()
        torch_backend.expand(ref_y, ref_rank, lora_b, scales, slice_sizes, meta)
        y_b, y_s = y.clone(), y.clone()
        bgmv_expand(y_b, ref_rank, lora_b, scales, slice_sizes, meta.token_slots)
        sgmv_expand(y_s, ref_rank, lora_b, scales, slice_sizes, meta.seg_starts, meta.seg_slots, max_seg)
        checks.close(f"bgmv_expand {name}", dtype, y_b, ref_y)
        checks.close(f"sgmv_expand {name}", dtype, y_s, ref_y)
        y_t, y_r = y.clone(), y.clone()
        TritonLoRABackend().apply(y_t, x, lora_a, lora_b, scales, slice_sizes, meta)
        torch_backend.apply(y_r, x, lora_a, lora_b, scales, slice_sizes, meta)
        checks.close(f"TritonLoRABackend.apply {name}", dtype, y_t, y_r)
    check_lora_paged(checks, dtype, device, tiny, in_features, slice_sizes, decode, prefill)


def _page_pool(
    ranks: list[int],
    page_rank: int,
    in_features: int,
    slice_sizes: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[list[list[int]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Adapters of ``ranks`` in pages of ``page_rank`` rows, pages shuffled over a pool with one
    free page (scale 0): each adapter's page ids, and the pool's (lora_a, lora_b, scales)."""
    depths = [-(-r // page_rank) for r in ranks]
    num_pages = sum(depths) + 1
    order = torch.randperm(num_pages).tolist()
    pages: list[list[int]] = []
    used = 0
    for depth in depths:
        pages.append(order[used : used + depth])
        used += depth
    num_slices, max_out = len(slice_sizes), max(slice_sizes)
    lora_a = torch.zeros(num_slices, num_pages, page_rank, in_features, device=device)
    lora_b = torch.zeros(num_slices, num_pages, max_out, page_rank, device=device)
    scales = torch.zeros(num_pages, device=device)
    for rank, adapter_pages in zip(ranks, pages, strict=True):
        for i, page in enumerate(adapter_pages):
            rows = min(page_rank, rank - i * page_rank)
            lora_a[:, page, :rows] = (
                torch.randn(num_slices, rows, in_features, device=device) / in_features**0.5
            )
            lora_b[:, page, :, :rows] = torch.randn(num_slices, max_out, rows, device=device) / rank**0.5
            scales[page] = 1.0
    return pages, (lora_a.to(dtype), lora_b.to(dtype), scales)


def _page_passes(
    adapters: list[int], pages: list[list[int]], device: torch.device
) -> tuple[LoRAMetadata, ...]:
    """Per pass i, each token's page i of its adapter (-1: none), as the engine builds them."""
    depth = max(len(pages[a]) for a in adapters if a >= 0)
    return tuple(
        LoRAMetadata.from_token_slots(
            [pages[a][i] if a >= 0 and len(pages[a]) > i else -1 for a in adapters], device
        )
        for i in range(depth)
    )


def check_lora_paged(
    checks: Checks,
    dtype: torch.dtype,
    device: torch.device,
    tiny: bool,
    in_features: int,
    slice_sizes: tuple[int, ...],
    decode: list[int],
    prefill: list[int],
) -> None:
    """``TritonLoRABackend.apply_paged`` (every page pass in one launch pair per kernel family)
    against the portable backend's per-pass loop: adapters 0-2 of ranks 24/16/4 (tiny) or
    64/16/8, in pages of 8."""
    ranks = [24, 16, 4] if tiny else [64, 16, 8]
    pages, (lora_a, lora_b, scales) = _page_pool(ranks, 8, in_features, slice_sizes, dtype, device)
    for name, adapters in (("decode", decode), ("prefill", prefill), ("mixed", decode + prefill)):
        passes = _page_passes(adapters, pages, device)
        x = torch.randn(len(adapters), in_features, device=device).to(dtype)
        y = torch.randn(len(adapters), sum(slice_sizes), device=device).to(dtype)
        y_t, y_r = y.clone(), y.clone()
        TritonLoRABackend().apply_paged(y_t, x, lora_a, lora_b, scales, slice_sizes, passes)
        PortableLoRABackend().apply_paged(y_r, x, lora_a, lora_b, scales, slice_sizes, passes)
        checks.close(f"TritonLoRABackend.apply_paged {name}", dtype, y_t, y_r)


# -- timings ------------------------------------------------------------------------------


def copy_bandwidth(timer: Timer, device: torch.device, num_bytes: int) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written) / time."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def _time_decode_config(
    timer: Timer, device: torch.device, tiny: bool, batch: int, context: int, copy_gbs: float
) -> dict[str, Any]:
    num_heads, kv_heads, head_dim, block_size = (4, 2, 64, 16) if tiny else (32, 8, 128, 16)
    dtype = torch.bfloat16
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    lens = [context] * batch
    k_cache, v_cache, table = _paged_cache(lens, block_size, kv_heads, head_dim, dtype, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_heads, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    paged_ms = timer(lambda: paged_decode(q, k_cache, v_cache, table, seq_lens, scale, context))
    no_split_ms = timer(
        lambda: paged_decode(q, k_cache, v_cache, table, seq_lens, scale, context, num_splits=1)
    )
    k = torch.randn(batch, kv_heads, context, head_dim, device=device).to(dtype)
    v = torch.randn_like(k)
    q4 = q.unsqueeze(2)
    sdpa_ms = timer(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
    kv_bytes = 2 * batch * context * kv_heads * head_dim * k.element_size()
    gbs = kv_bytes / (paged_ms * 1e-3) / 1e9
    return {
        "batch": batch,
        "context": context,
        "num_splits": choose_num_splits(batch, kv_heads, context, sms),
        "paged_ms": paged_ms,
        "paged_no_split_ms": no_split_ms,
        "contiguous_sdpa_ms": sdpa_ms,
        "kv_gb_per_s": gbs,
        "pct_of_copy_bw": 100 * gbs / copy_gbs,
        "paged_over_contiguous": paged_ms / sdpa_ms,
    }


def time_decode(timer: Timer, device: torch.device, tiny: bool, copy_gbs: float) -> list[dict[str, Any]]:
    """Paged decode (Llama-3-8B heads, bf16, block 16) over batch x context."""
    batches, contexts = ((1, 2), (40,)) if tiny else ((1, 16, 64), (512, 4096, 32768))
    return [
        _time_decode_config(timer, device, tiny, batch, context, copy_gbs)
        for batch in batches
        for context in contexts
    ]


def _time_lora_config(
    timer: Timer,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    slice_sizes: tuple[int, ...],
    phase: str,
    num_tokens: int,
    num_adapters: int,
) -> dict[str, Any]:
    lora_a, lora_b, scales, w_base = weights
    device, dtype = lora_a.device, lora_a.dtype
    x = torch.randn(num_tokens, w_base.shape[1], device=device).to(dtype)
    y = torch.zeros(num_tokens, sum(slice_sizes), device=device, dtype=dtype)
    if phase == "decode":  # requests interleave: token t uses adapter t % n
        slots = [t % num_adapters for t in range(num_tokens)]
    else:  # one prefill chunk per adapter
        per_adapter = -(-num_tokens // num_adapters)
        slots = [min(t // per_adapter, num_adapters - 1) for t in range(num_tokens)]
    meta = LoRAMetadata.from_token_slots(slots, device)
    backend = TritonLoRABackend()
    lora_ms = timer(lambda: backend.apply(y, x, lora_a, lora_b, scales, slice_sizes, meta))
    base_ms = timer(lambda: F.linear(x, w_base))
    return {
        "phase": phase,
        "tokens": num_tokens,
        "adapters": num_adapters,
        "lora_ms": lora_ms,
        "base_matmul_ms": base_ms,
        "lora_over_base": lora_ms / base_ms,
    }


def time_lora(timer: Timer, device: torch.device, tiny: bool) -> list[dict[str, Any]]:
    """LoRA apply (rank 16, fused q/k/v) vs the base q/k/v matmul, 1/16/64 distinct adapters."""
    hidden, slice_sizes = (96, (48, 16, 16)) if tiny else (4096, (4096, 1024, 1024))
    rank, max_loras, dtype = 16, 64, torch.bfloat16
    num_slices = len(slice_sizes)
    weights = (
        (torch.randn(num_slices, max_loras, rank, hidden, device=device) / hidden**0.5).to(dtype),
        (torch.randn(num_slices, max_loras, max(slice_sizes), rank, device=device) / rank**0.5).to(dtype),
        torch.ones(max_loras, device=device),
        (torch.randn(sum(slice_sizes), hidden, device=device) / hidden**0.5).to(dtype),
    )
    token_counts = {"decode": 4 if tiny else 64, "prefill": 16 if tiny else 4096}
    return [
        _time_lora_config(timer, weights, slice_sizes, phase, num_tokens, num_adapters)
        for phase, num_tokens in token_counts.items()
        for num_adapters in (1, 16, 64)
    ]


def time_lora_paged(timer: Timer, device: torch.device, tiny: bool) -> list[dict[str, Any]]:
    """Paged LoRA (pages of 8 rows, fused q/k/v): ``apply_paged`` with every pass in one launch
    pair per family vs the per-pass loop (``LoRABackend.apply_paged``), 16 adapters of ranks
    8/16/32/64 (1-8 passes), decode and prefill."""
    hidden, slice_sizes = (96, (48, 16, 16)) if tiny else (4096, (4096, 1024, 1024))
    dtype, num_adapters = torch.bfloat16, 16
    ranks = [(8, 16, 32, 64)[i % 4] for i in range(num_adapters)]
    pages, (lora_a, lora_b, scales) = _page_pool(ranks, 8, hidden, slice_sizes, dtype, device)
    backend = TritonLoRABackend()
    rows = []
    for phase, num_tokens in {"decode": 4 if tiny else 64, "prefill": 32 if tiny else 4096}.items():
        if phase == "decode":
            adapters = [t % num_adapters for t in range(num_tokens)]
        else:
            per_adapter = -(-num_tokens // num_adapters)
            adapters = [min(t // per_adapter, num_adapters - 1) for t in range(num_tokens)]
        passes = _page_passes(adapters, pages, device)
        x = torch.randn(num_tokens, hidden, device=device).to(dtype)
        y = torch.zeros(num_tokens, sum(slice_sizes), device=device, dtype=dtype)
        args = (y, x, lora_a, lora_b, scales, slice_sizes, passes)
        fused_ms = timer(lambda args=args: backend.apply_paged(*args))
        loop_ms = timer(lambda args=args: LoRABackend.apply_paged(backend, *args))
        rows.append(
            {
                "phase": phase,
                "tokens": num_tokens,
                "adapters": num_adapters,
                "passes": len(passes),
                "fused_ms": fused_ms,
                "per_pass_ms": loop_ms,
                "per_pass_over_fused": loop_ms / fused_ms,
            }
        )
    return rows


# -- main ----------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1"
    )
    parser.add_argument("--skip-timing", action="store_true", help="correctness only")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    started = time.perf_counter()
    tiny = args.cpu_smoke
    if tiny:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("no CUDA device: run with --cpu-smoke to exercise this script on the CPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)

    checks = Checks()
    # The smoke run keeps to bf16 (the interpreter's upcast path); a GPU checks both.
    for dtype in (torch.bfloat16,) if tiny else (torch.bfloat16, torch.float16):
        check_attention(checks, dtype, device, tiny)
        check_cache_ops(checks, dtype, device)
        check_lora(checks, dtype, device, tiny)
    print(f"{'correctness check':58} {'dtype':9} {'max abs err':>12}  result")
    for row in checks.rows:
        print(
            f"{row['check']:58} {row['dtype']:9} {row['max_abs_err']:12.3e}  {'ok' if row['ok'] else 'FAIL'}"
        )
    failed = [r for r in checks.rows if not r["ok"]]
    print(f"{len(checks.rows) - len(failed)}/{len(checks.rows)} correctness checks passed "
          f"({time.perf_counter() - started:.0f} s)\n")  # fmt: skip

    results: dict[str, Any] = {"device": str(device), "correctness": checks.rows}
    if device.type == "cuda":
        results["device_name"] = torch.cuda.get_device_name(device)
    if not args.skip_timing:
        timer = Timer(device, warmup=0 if tiny else 5, repeats=1 if tiny else 20)
        copy_gbs = copy_bandwidth(timer, device, (1 << 20) if tiny else (2 << 30))
        results["copy_gb_per_s"] = copy_gbs
        print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
        decode_rows = time_decode(timer, device, tiny, copy_gbs)
        results["decode"] = decode_rows
        print(f"{'batch':>5} {'ctx':>6} {'splits':>6} {'paged ms':>9} {'no-split ms':>11} {'sdpa ms':>8} "
              f"{'KV GB/s':>8} {'% copy':>7} {'paged/sdpa':>10}")  # fmt: skip
        for r in decode_rows:
            print(f"{r['batch']:5d} {r['context']:6d} {r['num_splits']:6d} {r['paged_ms']:9.3f} "
                  f"{r['paged_no_split_ms']:11.3f} {r['contiguous_sdpa_ms']:8.3f} {r['kv_gb_per_s']:8.0f} "
                  f"{r['pct_of_copy_bw']:6.0f}% {r['paged_over_contiguous']:10.2f}")  # fmt: skip
        lora_rows = time_lora(timer, device, tiny)
        results["lora"] = lora_rows
        print(
            f"\n{'phase':8} {'tokens':>6} {'adapters':>8} {'lora ms':>9} {'base mm ms':>10} {'lora/base':>9}"
        )
        for r in lora_rows:
            print(f"{r['phase']:8} {r['tokens']:6d} {r['adapters']:8d} {r['lora_ms']:9.3f} "
                  f"{r['base_matmul_ms']:10.3f} {r['lora_over_base']:9.3f}")  # fmt: skip
        paged_rows = time_lora_paged(timer, device, tiny)
        results["lora_paged"] = paged_rows
        print(f"\n{'paged':8} {'tokens':>6} {'passes':>6} {'fused ms':>9} {'per-pass ms':>11} {'speedup':>7}")
        for r in paged_rows:
            print(f"{r['phase']:8} {r['tokens']:6d} {r['passes']:6d} {r['fused_ms']:9.3f} "
                  f"{r['per_pass_ms']:11.3f} {r['per_pass_over_fused']:7.2f}")  # fmt: skip
    results["elapsed_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("gpu_kernels_cpu_smoke.json" if tiny else "gpu_kernels.json")
    path.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {path} ({results['elapsed_s']:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
