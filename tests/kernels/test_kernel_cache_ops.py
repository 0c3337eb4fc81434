"""KV cache ops: write_kv by slot, copy-on-write block copies, swaps between pools.

Triton and portable versions are both checked against element-by-element expectations
built with plain Python loops.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from support.kernels import DTYPES, kernel_device, swap_blocks

from loraplex.kernels.portable import cache_ops as portable_cache_ops
from loraplex.kernels.triton import cache_ops

DEVICE = kernel_device()

WriteKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
CopyBlocks = Callable[[list[torch.Tensor], torch.Tensor, torch.Tensor], None]


@pytest.mark.parametrize(
    "impl", [cache_ops.write_kv, portable_cache_ops.write_kv], ids=["triton", "portable"]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(8, 3, 64), (16, 1, 128), (32, 2, 64)])
def test_write_kv(
    impl: WriteKV, dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(block_size + head_dim)
    num_blocks = 6
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    # Slots across blocks, a block's first and last rows, and skipped (-1) tokens.
    slots = [0, block_size - 1, block_size, 3 * block_size + 5, -1, num_blocks * block_size - 1, -1, 2]
    key = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    impl(key, value, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64, device=DEVICE))

    expected_k = torch.zeros_like(k_cache)
    expected_v = torch.zeros_like(v_cache)
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[t]
            expected_v[slot // block_size, slot % block_size] = value[t]
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_write_kv_from_strided_views() -> None:
    # K and V come out of a fused qkv projection as strided views.
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (4 + 2 + 2) * 64, generator=gen).to(DEVICE)
    k = qkv[:, 4 * 64 : 6 * 64].view(5, 2, 64)
    v = qkv[:, 6 * 64 :].view(5, 2, 64)
    k_cache = torch.zeros(3, 8, 2, 64, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 9, 17, 20, 23], device=DEVICE)
    cache_ops.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 64)[slots], k)
    assert torch.equal(v_cache.view(-1, 2, 64)[slots], v)


@pytest.mark.parametrize(
    "impl", [cache_ops.copy_blocks, portable_cache_ops.copy_blocks], ids=["triton", "portable"]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_copy_blocks(impl: CopyBlocks, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    caches = [torch.randn(8, 16, 2, 64, generator=gen).to(dtype).to(DEVICE) for _ in range(3)]
    before = [c.clone() for c in caches]
    src, dst = [1, 4, 0], [6, 2, 7]
    impl(caches, torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE))
    for cache, old in zip(caches, before, strict=True):
        for b in range(8):
            expected = old[src[dst.index(b)]] if b in dst else old[b]
            assert torch.equal(cache[b], expected), f"block {b}"


def test_copy_blocks_between_pools() -> None:
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(10, 8, 3, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    staging = torch.zeros(4, 8, 3, 64, dtype=torch.bfloat16, device=DEVICE)
    cache_ops.copy_blocks_between(
        big, staging, torch.tensor([9, 2], device=DEVICE), torch.tensor([1, 3], device=DEVICE)
    )
    assert torch.equal(staging[1], big[9]) and torch.equal(staging[3], big[2])
    assert not staging[0].any() and not staging[2].any()
    # And back into different blocks of the big pool.
    big_before = big.clone()
    cache_ops.copy_blocks_between(
        staging, big, torch.tensor([1], device=DEVICE), torch.tensor([0], device=DEVICE)
    )
    assert torch.equal(big[0], big_before[9]) and torch.equal(big[1:], big_before[1:])


def test_swap_blocks_ref() -> None:
    gen = torch.Generator().manual_seed(4)
    device_pool = torch.randn(6, 16, 2, 64, generator=gen).to(DEVICE)
    host_pool = torch.zeros(3, 16, 2, 64)
    swap_blocks(device_pool, host_pool, torch.tensor([5, 0]), torch.tensor([2, 0]))
    assert torch.equal(host_pool[2], device_pool[5].cpu()) and torch.equal(host_pool[0], device_pool[0].cpu())
    assert not host_pool[1].any()
    swap_blocks(host_pool, device_pool, torch.tensor([2]), torch.tensor([1]))
    assert torch.equal(device_pool[1], device_pool[5])
