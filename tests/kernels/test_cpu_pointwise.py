"""The fused C pointwise kernels (RMSNorm with residual add, per-head RMSNorm, RoPE, SiLU-and-mul)
and C KV writes.

Compared with float64 math written out here, and with the portable (torch) backend,
on SmolLM2's shapes and odd ones: strided rows, 1 row and enough rows that the
kernels run on several threads.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.cpu.attention import CpuAttentionBackend
from loraplex.kernels.cpu.pointwise import CpuPointwiseBackend
from loraplex.kernels.portable.attention import PortableAttentionBackend
from loraplex.kernels.portable.pointwise import PortablePointwiseBackend

ROWS = [1, 33, 300]  # 300 x 576 crosses the kernels' multi-thread threshold


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_float64(rows: int, with_delta: bool) -> None:
    g = _gen(rows)
    base = torch.randn(rows, 700, generator=g)
    residual = base[:, 10:586]  # strided rows
    delta = torch.randn(rows, 576, generator=g) if with_delta else None
    weight = torch.randn(576, generator=g)
    r64 = residual.double() + (0 if delta is None else delta.double())
    expected = weight.double() * r64 / torch.sqrt(r64.pow(2).mean(-1, keepdim=True) + 1e-5)
    normed, new_residual = CpuPointwiseBackend().add_rms_norm(delta, residual, weight, 1e-5)
    torch.testing.assert_close(normed.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_residual.double(), r64, atol=1e-6, rtol=0)
    if delta is not None:
        assert new_residual.data_ptr() == residual.data_ptr(), "the residual is updated in place"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("backend", [CpuPointwiseBackend(), PortablePointwiseBackend()], ids=["c", "torch"])
def test_head_rms_norm_matches_float64_in_place(rows: int, backend: PortablePointwiseBackend) -> None:
    """Qwen3's q norm: 9 heads of 64 inside a fused qkv row (strided), normed in place; the k
    heads after them and the rest of the row untouched."""
    g = _gen(200 + rows)
    qkv = torch.randn(rows, 960, generator=g)
    before = qkv.clone()
    weight = torch.randn(64, generator=g)
    backend.head_rms_norm(qkv[:, :576], weight, 1e-6)
    h64 = before[:, :576].double().view(rows, 9, 64)
    expected = weight.double() * h64 / torch.sqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(qkv[:, :576].double().view(rows, 9, 64), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, 576:], before[:, 576:])


@pytest.mark.parametrize("rows", ROWS)
def test_rotary_matches_float64_and_leaves_v_alone(rows: int) -> None:
    g = _gen(100 + rows)
    qkv = torch.randn(rows, 960, generator=g)
    angles = torch.rand(rows, 32, generator=g) * 50
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    x = qkv[:, :768].double().view(rows, 12, 64)
    x1, x2 = x[..., :32], x[..., 32:]
    c, s = cos.double()[:, None], sin.double()[:, None]
    expected = torch.cat([x1 * c[..., :32] - x2 * s[..., :32], x2 * c[..., 32:] + x1 * s[..., 32:]], -1)
    out = qkv.clone()
    CpuPointwiseBackend().rotary(out[:, :768], cos, sin, 64)
    torch.testing.assert_close(out[:, :768].double().view(rows, 12, 64), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[:, 768:], qkv[:, 768:]), "the v part of the row must not move"


@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_matches_float64(rows: int) -> None:
    g = _gen(200 + rows)
    gate_up = torch.randn(rows, 3072, generator=g) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturating and signed-zero inputs
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = gate * torch.sigmoid(gate) * up
    out = CpuPointwiseBackend().silu_and_mul(gate_up)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_other_dtypes_take_the_portable_path() -> None:
    fast, ref = CpuPointwiseBackend(), PortablePointwiseBackend()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(fast.add_rms_norm(None, x, w, 1e-6)[0], ref.add_rms_norm(None, x, w, 1e-6)[0])
    gu = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(fast.silu_and_mul(gu), ref.silu_and_mul(gu))


def test_kv_write_by_slot_skips_negative_and_refuses_out_of_range() -> None:
    g = _gen(7)
    qkv = torch.randn(5, 3 * 2 * 64, generator=g)  # q | k | v of 2 kv heads each
    key = qkv[:, 128:256].view(5, 2, 64)
    value = qkv[:, 256:].view(5, 2, 64)
    slots = torch.tensor([3, -1, 17, 0, 31])
    caches = [torch.zeros(4, 8, 2, 64) for _ in range(4)]
    CpuAttentionBackend().write_kv(key, value, caches[0], caches[1], slots)
    PortableAttentionBackend().write_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    rows = caches[0].view(-1, 2, 64)
    assert torch.equal(rows[17], key[2]) and rows[1].abs().sum() == 0
    with pytest.raises(IndexError, match="outside the cache"):
        CpuAttentionBackend().write_kv(key, value, caches[0], caches[1], torch.tensor([0, 1, 2, 3, 32]))
