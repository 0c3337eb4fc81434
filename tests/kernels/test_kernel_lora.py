"""LoRA shrink/expand: Triton BGMV/SGMV kernels and the portable (torch) backend vs per-token naive math.

Every batch mixes adapters of ranks 8, 16 and 64 (padded to 64), tokens without an
adapter (-1), and adapters that repeat and interleave; fused projections stack
three unequal slices (q/k/v under GQA) or two equal ones (gate/up).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable

import pytest
import torch
from support.kernels import (
    DTYPES,
    LoRAWeights,
    assert_close,
    kernel_device,
    make_lora_weights,
    naive_lora_delta,
    naive_lora_shrink,
)

from loraplex.kernels.contracts import LoRABackend
from loraplex.kernels.cpu.lora import CpuLoRABackend
from loraplex.kernels.metadata import LoRAMetadata
from loraplex.kernels.portable.lora import DIRECT_MIN_RUN, PortableLoRABackend, group_tokens, plan_buckets
from loraplex.kernels.triton.lora_backend import TritonLoRABackend
from loraplex.kernels.triton.lora_expand import bgmv_expand, sgmv_expand
from loraplex.kernels.triton.lora_shrink import bgmv_shrink, sgmv_shrink

DEVICE = kernel_device()
RANKS = [8, 64, 16, 8]  # slot -> rank; slot 3 is resident but unused in most batches

# Decode-like: one token per sequence, slots interleaved and repeated, some base-only.
DECODE_SLOTS = [0, 2, -1, 1, 0, 0, 2, -1, 1, 2, 0]
# Prefill-like: runs of one slot, long (>= 16, SGMV) and short, with a base-only run.
PREFILL_SLOTS = [1] * 20 + [-1] * 5 + [0] * 17 + [2] * 3 + [0] * 18 + [1] * 2
# What the engine sends: decodes first, then prefill chunks.
MIXED_SLOTS = DECODE_SLOTS + PREFILL_SLOTS

SLICE_LAYOUTS = {"qkv": (48, 16, 16), "gate_up": (40, 40)}
IN_FEATURES = 96  # not a power of two: exercises the K-loop masks


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _setup(
    slots: list[int], layout: str, dtype: torch.dtype, seed: int, device: torch.device = DEVICE
) -> tuple[torch.Tensor, torch.Tensor, LoRAWeights, LoRAMetadata]:
    gen = torch.Generator().manual_seed(seed)
    w = make_lora_weights(IN_FEATURES, SLICE_LAYOUTS[layout], RANKS, dtype, device, gen)
    x = torch.randn(len(slots), IN_FEATURES, generator=gen).to(dtype).to(device)
    y = torch.randn(len(slots), sum(w.slice_sizes), generator=gen).to(dtype).to(device)
    return x, y, w, LoRAMetadata.from_token_slots(slots, device)


def _max_seg_len(meta: LoRAMetadata) -> int:
    starts = meta.seg_starts_cpu
    return max(b - a for a, b in itertools.pairwise(starts))


# -- the raw kernels ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("split_k", [1, 2])
def test_bgmv_shrink(dtype: torch.dtype, split_k: int) -> None:
    x, _, w, meta = _setup(DECODE_SLOTS, "qkv", dtype, seed=1)
    out = bgmv_shrink(x, w.lora_a, meta.token_slots, split_k=split_k)
    expected = naive_lora_shrink(x, w, DECODE_SLOTS)
    assert_close(out, expected, torch.float32 if dtype == torch.float32 else torch.float16, "bgmv_shrink")
    reference = PortableLoRABackend().shrink(x, w.lora_a, meta)
    assert_close(out, reference.double(), dtype, "bgmv_shrink vs torch")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("split_k", [1, 2])
def test_sgmv_shrink(dtype: torch.dtype, split_k: int) -> None:
    x, _, w, meta = _setup(PREFILL_SLOTS, "gate_up", dtype, seed=2)
    out = sgmv_shrink(x, w.lora_a, meta.seg_starts, meta.seg_slots, _max_seg_len(meta), split_k=split_k)
    expected = naive_lora_shrink(x, w, PREFILL_SLOTS)
    assert_close(out, expected, torch.float32 if dtype == torch.float32 else torch.float16, "sgmv_shrink")
    reference = PortableLoRABackend().shrink(x, w.lora_a, meta)
    assert_close(out, reference.double(), dtype, "sgmv_shrink vs torch")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("layout", sorted(SLICE_LAYOUTS))
def test_bgmv_expand(dtype: torch.dtype, layout: str) -> None:
    x, y, w, meta = _setup(DECODE_SLOTS, layout, dtype, seed=3)
    x_rank = naive_lora_shrink(x, w, DECODE_SLOTS).float().to(DEVICE)
    expected = y.double().cpu() + _naive_expand(x_rank, w, DECODE_SLOTS)
    reference = y.clone()
    PortableLoRABackend().expand(reference, x_rank, w.lora_b, w.scales, w.slice_sizes, meta)
    bgmv_expand(y, x_rank, w.lora_b, w.scales, w.slice_sizes, meta.token_slots)
    assert_close(y, expected, dtype, "bgmv_expand")
    assert_close(y, reference.double(), dtype, "bgmv_expand vs torch")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("layout", sorted(SLICE_LAYOUTS))
def test_sgmv_expand(dtype: torch.dtype, layout: str) -> None:
    x, y, w, meta = _setup(PREFILL_SLOTS, layout, dtype, seed=4)
    x_rank = naive_lora_shrink(x, w, PREFILL_SLOTS).float().to(DEVICE)
    expected = y.double().cpu() + _naive_expand(x_rank, w, PREFILL_SLOTS)
    reference = y.clone()
    PortableLoRABackend().expand(reference, x_rank, w.lora_b, w.scales, w.slice_sizes, meta)
    sgmv_expand(
        y, x_rank, w.lora_b, w.scales, w.slice_sizes, meta.seg_starts, meta.seg_slots, _max_seg_len(meta)
    )
    assert_close(y, expected, dtype, "sgmv_expand")
    assert_close(y, reference.double(), dtype, "sgmv_expand vs torch")


def _naive_expand(x_rank: torch.Tensor, w: LoRAWeights, slots: list[int]) -> torch.Tensor:
    """scale * x_rank @ B^T per token and slice, float64."""
    b = w.lora_b.double().cpu()
    xr = x_rank.double().cpu()
    out = torch.zeros(len(slots), sum(w.slice_sizes), dtype=torch.float64)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        col = 0
        for s, size in enumerate(w.slice_sizes):
            out[t, col : col + size] = float(w.scales[slot]) * (b[s, slot, :size] @ xr[s, t])
            col += size
    return out


# -- whole backends: apply = shrink + expand ---------------------------------------------

BACKENDS: dict[str, Callable[[], LoRABackend]] = {
    "torch": PortableLoRABackend,
    "triton-auto": lambda: TritonLoRABackend("auto"),
    "triton-bgmv": lambda: TritonLoRABackend("bgmv"),
    "triton-sgmv": lambda: TritonLoRABackend("sgmv"),
}
if DEVICE.type == "cpu":
    BACKENDS["cpu"] = CpuLoRABackend  # the C kernels: CPU only
BATCHES = {"decode": DECODE_SLOTS, "prefill": PREFILL_SLOTS, "mixed": MIXED_SLOTS}


ApplyCase = tuple[str, str, torch.dtype]
# A forced kernel family in half precision adds nothing over the kernel tests above
# but minutes of interpreter time, so those cases are left out of both grids.
ALL_APPLY_CASES = [
    (name, batch, dtype)
    for name in BACKENDS
    for batch in BATCHES
    for dtype in DTYPES
    if name in ("torch", "triton-auto", "cpu") or dtype == torch.float32
]


def _fast_apply_case(case: ApplyCase) -> bool:
    # Interpreted Triton is slow: the default run gives each Triton mode the mixed
    # batch, "auto" every batch in fp32; the kernel tests above cover each dtype.
    name, batch, dtype = case
    if name in ("torch", "cpu") or (batch == "mixed" and (name == "triton-auto" or dtype == torch.float32)):
        return True
    return name == "triton-auto" and dtype == torch.float32


def _apply_id(case: ApplyCase) -> str:
    name, batch, dtype = case
    return f"{name}-{batch}-{_dtype_id(dtype)}"


def _in_backend_layout(backend: LoRABackend, w: LoRAWeights) -> LoRAWeights:
    """A copy of ``w`` in the weight layout ``backend`` reads (as the slot buffers store it);
    naive math keeps using ``w``."""
    lora_a, lora_b = backend.weight_layout(w.lora_a.dtype, w.lora_a.device).pack(w.lora_a, w.lora_b)
    return dataclasses.replace(w, lora_a=lora_a, lora_b=lora_b)


def _check_apply(case: ApplyCase) -> None:
    name, batch, dtype = case
    slots = BATCHES[batch]
    backend: LoRABackend = BACKENDS[name]()
    x, y, w, meta = _setup(slots, "qkv", dtype, seed=5)
    packed = _in_backend_layout(backend, w)
    expected = y.double().cpu() + naive_lora_delta(x, w, slots)
    backend.apply(y, x, packed.lora_a, packed.lora_b, w.scales, w.slice_sizes, meta)
    assert_close(y, expected, dtype, f"{name} apply on {batch}")


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in ALL_APPLY_CASES if _fast_apply_case(c)], ids=_apply_id)
def test_backend_apply(case: ApplyCase) -> None:
    _check_apply(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in ALL_APPLY_CASES if not _fast_apply_case(c)], ids=_apply_id)
def test_backend_apply_grid(case: ApplyCase) -> None:
    _check_apply(case)


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", ["torch", "triton-auto", *(["cpu"] if "cpu" in BACKENDS else [])])
def test_backend_apply_reuses_plan_across_projections(backend_name: str) -> None:
    # One metadata object, two projections with different layouts: the cached
    # grouping must serve both, and a new metadata object must replace it.
    backend: LoRABackend = BACKENDS[backend_name]()
    for slots in (MIXED_SLOTS, DECODE_SLOTS[::-1]):
        meta = LoRAMetadata.from_token_slots(slots, DEVICE)
        for layout in ("qkv", "gate_up"):
            gen = torch.Generator().manual_seed(len(slots))
            w = make_lora_weights(IN_FEATURES, SLICE_LAYOUTS[layout], RANKS, torch.float32, DEVICE, gen)
            packed = _in_backend_layout(backend, w)
            x = torch.randn(len(slots), IN_FEATURES, generator=gen).to(DEVICE)
            y = torch.zeros(len(slots), sum(w.slice_sizes), device=DEVICE)
            backend.apply(y, x, packed.lora_a, packed.lora_b, w.scales, w.slice_sizes, meta)
            assert_close(y, naive_lora_delta(x, w, slots), torch.float32, f"{layout} after cache")


@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
def test_backend_apply_without_adapters_is_a_no_op(backend_name: str) -> None:
    x, y, w, meta = _setup([-1] * 7, "qkv", torch.float32, seed=6)
    before = y.clone()
    BACKENDS[backend_name]().apply(y, x, w.lora_a, w.lora_b, w.scales, w.slice_sizes, meta)
    assert torch.equal(y, before)


# -- portable backend specifics ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_torch_shrink_then_expand(dtype: torch.dtype) -> None:
    # The two halves on their own (the engine uses apply; the API offers both).
    x, y, w, meta = _setup(MIXED_SLOTS, "qkv", dtype, seed=7)
    backend = PortableLoRABackend()
    x_rank = backend.shrink(x, w.lora_a, meta)
    assert x_rank.dtype == torch.float32 and x_rank.shape == (3, len(MIXED_SLOTS), max(RANKS))
    assert_close(x_rank, naive_lora_shrink(x, w, MIXED_SLOTS), dtype, "torch shrink")
    expected = y.double().cpu() + naive_lora_delta(x, w, MIXED_SLOTS)
    backend.expand(y, x_rank, w.lora_b, w.scales, w.slice_sizes, meta)
    assert_close(y, expected, dtype, "torch shrink + expand")


def test_torch_grouping_runs_and_buckets() -> None:
    # A long run is served directly; short runs group by slot and share a bucket when
    # padding them is cheaper than another bucket.
    slots = [2] * DIRECT_MIN_RUN + [0, 1, 0, -1, 1, 0, 3] + [1] * 3
    grouping = group_tokens(LoRAMetadata.from_token_slots(slots, torch.device("cpu")), torch.device("cpu"))
    assert [(r.slot, r.start, r.end) for r in grouping.runs] == [(2, 0, DIRECT_MIN_RUN)]
    base = DIRECT_MIN_RUN
    # slot 0: 3 tokens, slot 1: 5, slot 3: 1 -> one bucket of length 5 over the slot range 0..3
    # (slot 2, whose tokens ran directly, is an empty group there).
    (bucket,) = grouping.buckets
    assert bucket.group_len == 5 and bucket.slot_range == (0, 4)
    assert bucket.slots.tolist() == [0, 1, 2, 3]
    zeros, ones = [base, base + 2, base + 5], [base + 1, base + 4, base + 7, base + 8, base + 9]
    assert bucket.gather_index.tolist() == zeros + [0, 0] + ones + [0] * 5 + [base + 6] + [0] * 4
    assert bucket.valid is not None
    valid = [1.0] * 3 + [0.0] * 2 + [1.0] * 5 + [0.0] * 5 + [1.0] + [0.0] * 4
    assert bucket.valid.flatten().tolist() == valid


def _plan_cost(lengths: list[int], plan: list[tuple[int, int]], bucket_cost: int) -> int:
    return sum(bucket_cost + (hi - lo) * max(lengths[lo:hi]) for lo, hi in plan)


def _all_partitions(items: list[int]) -> list[list[list[int]]]:
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for part in _all_partitions(rest):
        out.append([[first], *part])
        for i in range(len(part)):
            out.append([*part[:i], [first, *part[i]], *part[i + 1 :]])
    return out


@pytest.mark.parametrize("seed", range(6))
def test_plan_buckets_is_optimal(seed: int) -> None:
    # Against brute force over *every* partition (not only contiguous ranges) of small inputs.
    rng = random.Random(seed)
    lengths = sorted(rng.choice([1, 1, 2, 3, 5, 8, 40, 64]) for _ in range(rng.randint(1, 7)))
    cost = rng.choice([0, 4, 32, 200])
    plan = plan_buckets(lengths, cost)
    assert [i for lo, hi in plan for i in range(lo, hi)] == list(range(len(lengths)))
    brute = min(
        sum(cost + len(b) * max(lengths[i] for i in b) for b in part)
        for part in _all_partitions(list(range(len(lengths))))
    )
    assert _plan_cost(lengths, plan, cost) == brute


def test_plan_buckets_examples() -> None:
    assert plan_buckets([], 32) == []
    assert plan_buckets([1] * 20, 32) == [(0, 20)]  # one bucket, no padding
    assert plan_buckets([1, 1, 1, 64], 32) == [(0, 3), (3, 4)]  # the long group stands alone
    assert plan_buckets([1, 2, 4, 8], 0) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # free buckets: no padding


def test_torch_bucket_padding_is_inert() -> None:
    # Slot 0 has 3 tokens and slot 1 has 4: one bucket of length 4, slot 0 padded by a row.
    slots = [0, 1, 0, 1, 0, 1, 1, -1]
    meta = LoRAMetadata.from_token_slots(slots, DEVICE)
    grouping = group_tokens(meta, DEVICE)
    assert len(grouping.buckets) == 1 and grouping.buckets[0].valid is not None
    gen = torch.Generator().manual_seed(8)
    w = make_lora_weights(IN_FEATURES, (32,), [16, 16], torch.float32, DEVICE, gen)
    # A huge token 0: if a padding row (which reads token 0) leaked, y[0] would blow up.
    x = torch.randn(len(slots), IN_FEATURES, generator=gen).to(DEVICE)
    x[0] *= 1e3
    y = torch.zeros(len(slots), 32, device=DEVICE)
    PortableLoRABackend().apply(y, x, w.lora_a, w.lora_b, w.scales, w.slice_sizes, meta)
    assert_close(y, naive_lora_delta(x, w, slots), torch.float32, "padded bucket")


@pytest.mark.parametrize(
    "slots,slot_range",
    [
        ([0, 2, 0, 2], (0, 3)),  # one hole (slot 1): an empty group keeps the range view
        ([0, 3, 0, 3], None),  # slots 0 and 3: too sparse, the adapters are gathered
        ([5, 6, 7, 5, 6, 7], (5, 8)),
    ],
)
def test_torch_bucket_slot_ranges(slots: list[int], slot_range: tuple[int, int] | None) -> None:
    meta = LoRAMetadata.from_token_slots(slots, DEVICE)
    (bucket,) = group_tokens(meta, DEVICE).buckets
    assert bucket.slot_range == slot_range
    gen = torch.Generator().manual_seed(9)
    w = make_lora_weights(IN_FEATURES, (24, 8), [8, 16, 64, 8, 16, 64, 8, 16], torch.float32, DEVICE, gen)
    x = torch.randn(len(slots), IN_FEATURES, generator=gen).to(DEVICE)
    y = torch.zeros(len(slots), 32, device=DEVICE)
    PortableLoRABackend().apply(y, x, w.lora_a, w.lora_b, w.scales, w.slice_sizes, meta)
    assert_close(y, naive_lora_delta(x, w, slots), torch.float32, f"bucket over slots {slots}")


# -- CPU backend specifics (on the CPU on every machine: the C kernels take CPU tensors) --

CPU = torch.device("cpu")


def test_cpu_backend_serves_runs_and_decodes_and_falls_back() -> None:
    """Packed weights go to the C kernel; logical ones, and packed ones with an x the
    kernel cannot read (strided columns), go to the torch path with the same result."""
    from loraplex.kernels.cpu.lora import supports

    # A 20-token run and interleaved decodes over 4 slots and no adapter.
    slots = [1] * 20 + [0, 2, -1, 2, 0, 1, 1, 3, -1, 2]
    x, y, w, meta = _setup(slots, "gate_up", torch.float32, seed=11, device=CPU)
    expected = y.double() + naive_lora_delta(x, w, slots)
    backend = CpuLoRABackend()
    packed = _in_backend_layout(backend, w)
    assert packed.lora_a.dim() == 3 and packed.lora_b.dim() == 5  # the CPU layout, not the logical one
    sizes = w.slice_sizes
    assert not supports(y, x, w.lora_a, w.lora_b, w.scales, sizes)
    assert supports(y, x, packed.lora_a, packed.lora_b, w.scales, sizes)
    strided_x = torch.stack([x, torch.full_like(x, float("nan"))], dim=2).flatten(1)[:, ::2]
    assert torch.equal(strided_x, x) and not supports(
        y, strided_x, packed.lora_a, packed.lora_b, w.scales, sizes
    )
    cases = [
        ("torch path, logical weights", x, w.lora_a, w.lora_b),
        ("torch path, packed weights seen logically", strided_x, packed.lora_a, packed.lora_b),
        ("C kernel", x, packed.lora_a, packed.lora_b),
    ]
    for label, xs, lora_a, lora_b in cases:
        out = y.clone()
        backend.apply(out, xs, lora_a, lora_b, w.scales, w.slice_sizes, meta)
        assert_close(out, expected, torch.float32, f"cpu backend, {label}")


def test_cpu_kernel_rejects_slots_outside_the_buffers() -> None:
    from loraplex.kernels.cpu.lora import PackedWeights, TokenGroups, lora_grouped_cpu

    x, y, w, _ = _setup([0, 1], "qkv", torch.float32, seed=12, device=CPU)
    w = _in_backend_layout(CpuLoRABackend(), w)
    groups = TokenGroups.from_slot_tokens({len(RANKS): [0, 1]})
    with pytest.raises(ValueError, match="outside"):
        weights = PackedWeights.check(w.lora_a, w.lora_b, w.scales, w.slice_sizes)
        assert weights is not None
        lora_grouped_cpu(y, x, weights, groups)


def test_cpu_kernel_odd_rank_wide_slices_and_partial_token_blocks() -> None:
    """A max rank that is not a multiple of 4, a slice wider than one output chunk (512),
    and groups of 1-6 tokens (full and partial blocks of 4)."""
    gen = torch.Generator().manual_seed(13)
    slice_sizes = (600, 40)
    ranks = [3, 5, 2]
    w = make_lora_weights(IN_FEATURES, slice_sizes, ranks, torch.float32, CPU, gen)
    packed = _in_backend_layout(CpuLoRABackend(), w)
    slots = [0, 1, 2, 1, 0, -1, 1, 1, 0, 1, 1, 2, 0, 0]  # slot 1: 6 tokens, slot 0: 5, slot 2: 2
    x = torch.randn(len(slots), IN_FEATURES, generator=gen)
    y = torch.randn(len(slots), sum(slice_sizes), generator=gen)
    expected = y.double() + naive_lora_delta(x, w, slots)
    meta = LoRAMetadata.from_token_slots(slots, CPU)
    CpuLoRABackend().apply(y, x, packed.lora_a, packed.lora_b, w.scales, w.slice_sizes, meta)
    assert_close(y, expected, torch.float32, "odd rank, wide slice")


@pytest.mark.parametrize("run_len", [15, 16, 17, 33, 70])
def test_cpu_kernel_work_items_across_long_runs(run_len: int) -> None:
    """A prefill run split into work items of 16 tokens (a partial last item and a
    partial last block of 4), the same slot again later in the batch (one group of
    non-consecutive tokens), and decodes of other slots in between."""
    slots = [2] * run_len + [0, 1, -1, 2, 0] + [1] * (run_len // 2) + [2, 0]
    x, y, w, meta = _setup(slots, "qkv", torch.float32, seed=14, device=CPU)
    packed = _in_backend_layout(CpuLoRABackend(), w)
    expected = y.double() + naive_lora_delta(x, w, slots)
    CpuLoRABackend().apply(y, x, packed.lora_a, packed.lora_b, w.scales, w.slice_sizes, meta)
    assert_close(y, expected, torch.float32, f"C kernel, run of {run_len}")


@pytest.mark.parametrize(
    "slice_sizes,ranks",
    [
        ((64,), [16, 9]),  # n_pad 16: one vector of rank columns
        ((40, 72), [16, 16]),  # 32: two
        ((48, 16, 16), [16, 4]),  # 48: three
        ((64,), [64, 33]),  # 64: four
        ((48, 16, 16), [8, 8]),  # 24: one vector and a half (8 columns)
        ((64,), [8, 5]),  # 8: a half vector only (a rank-8 page of o or down)
        ((40, 72), [20, 8]),  # 40: two vectors and a half
        ((24, 200), [36, 7]),  # 72: four vectors and a half
        ((48, 16, 16), [7, 3]),  # 21 -> 24: padded columns in the half
        ((24, 200), [40, 7]),  # 80: a group of four vectors and one of one
    ],
    ids=lambda v: str(v),
)
def test_cpu_kernel_shrink_tiles(slice_sizes: tuple[int, ...], ranks: list[int]) -> None:
    """Every shrink tile shape (1-4 vectors of rank columns and a last half vector, rows of 4
    and the widest tile) on groups of 1 to 17 tokens, interleaved, over 300 input features (two whole
    chunks of 128 and a partial one)."""
    in_features = 300
    counts = [1, 17, 4, 12, 5, 13, 16, 8, 6, 2]  # tokens of slot i
    slot_ranks = [ranks[i % len(ranks)] for i in range(len(counts))]
    gen = torch.Generator().manual_seed(sum(slice_sizes) + sum(ranks))
    w = make_lora_weights(in_features, slice_sizes, slot_ranks, torch.float32, CPU, gen)
    packed = _in_backend_layout(CpuLoRABackend(), w)
    slots = [slot for slot, n in enumerate(counts) for _ in range(n)]
    random.Random(len(slots)).shuffle(slots)
    x = torch.randn(len(slots), in_features, generator=gen)
    y = torch.randn(len(slots), sum(slice_sizes), generator=gen)
    expected = y.double() + naive_lora_delta(x, w, slots)
    meta = LoRAMetadata.from_token_slots(slots, CPU)
    CpuLoRABackend().apply(y, x, packed.lora_a, packed.lora_b, w.scales, w.slice_sizes, meta)
    assert_close(y, expected, torch.float32, f"shrink tiles for {slice_sizes} ranks {ranks}")
