"""Triton LoRA over adapter pages: every page pass of a projection in one launch per kernel family.

Adapters of ranks 4, 8, 16 and 24 live in pages of P = 8 rank rows (1, 1, 2 and 3 pages,
scattered over the pool, one free page among them); batches hold tokens without an adapter,
decodes (BGMV), prefill runs of >= 16 tokens (SGMV) or both; the projections stack q/k/v
(64, 16, 16) or gate/up (40, 40). The reference is the per-pass loop
(``LoRABackend.apply_paged``'s default) on the portable backend, and float64 naive math
summed over the passes. Under ``TRITON_INTERPRET=1`` (``conftest.py``) on a machine
without CUDA.
"""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from support.kernels import (
    LoRAWeights,
    assert_close,
    kernel_device,
    make_lora_weights,
    naive_lora_delta,
    naive_lora_shrink,
)

from loraplex.kernels.contracts import LoRABackend
from loraplex.kernels.metadata import LoRAMetadata
from loraplex.kernels.portable.lora import PortableLoRABackend
from loraplex.kernels.triton.lora_backend import (
    LoRAKernelMode,
    TritonLoRABackend,
    page_segments,
)
from loraplex.kernels.triton.lora_shrink import bgmv_shrink_paged, sgmv_shrink_paged

DEVICE = kernel_device()
PAGE_RANK = 8
IN_FEATURES = 96  # not a power of two: exercises the K-loop masks
SLICE_LAYOUTS = {"qkv": (64, 16, 16), "gate_up": (40, 40)}

# Adapter -> its pages, in order (ranks 4, 8, 16, 24 in pages of 8). Page 5 is free.
ADAPTER_RANKS = [4, 8, 16, 24]
ADAPTER_PAGES = [[3], [7], [0, 6], [4, 1, 2]]
NUM_PAGES = 8
FREE_PAGE = 5

# Adapter per token (-1: base model only).
DECODE = [3, 0, -1, 2, 1, 3, 2, -1, 0, 1, 3, 2]  # every run short: BGMV
PREFILL = [3] * 17 + [-1] * 3 + [2] * 16 + [1] * 20  # every adapter run >= 16: SGMV
MIXED = DECODE + PREFILL  # both families
BATCHES = {"decode": DECODE, "prefill": PREFILL, "mixed": MIXED}


def _page_ranks() -> list[int]:
    """Rank rows used in each page (the last page of a rank-4 adapter is half empty)."""
    ranks = [PAGE_RANK] * NUM_PAGES
    for rank, pages in zip(ADAPTER_RANKS, ADAPTER_PAGES, strict=True):
        for i, page in enumerate(pages):
            ranks[page] = min(PAGE_RANK, rank - i * PAGE_RANK)
    return ranks


def _pass_slots(adapters: list[int]) -> list[list[int]]:
    """Per pass, each token's page (as ``_StepPages`` builds them)."""
    depth = max((len(ADAPTER_PAGES[a]) for a in adapters if a >= 0), default=0)
    return [
        [ADAPTER_PAGES[a][i] if a >= 0 and len(ADAPTER_PAGES[a]) > i else -1 for a in adapters]
        for i in range(depth)
    ]


def _passes(pass_slots: list[list[int]]) -> tuple[LoRAMetadata, ...]:
    return tuple(LoRAMetadata.from_token_slots(slots, DEVICE) for slots in pass_slots)


def _setup(
    num_tokens: int, layout: str, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, LoRAWeights]:
    gen = torch.Generator().manual_seed(seed)
    w = make_lora_weights(IN_FEATURES, SLICE_LAYOUTS[layout], _page_ranks(), dtype, DEVICE, gen)
    w.scales[FREE_PAGE] = 0.0  # as in the page pool
    x = torch.randn(num_tokens, IN_FEATURES, generator=gen).to(dtype).to(DEVICE)
    y = torch.randn(num_tokens, sum(w.slice_sizes), generator=gen).to(dtype).to(DEVICE)
    return x, y, w


def _apply_paged(
    backend: LoRABackend, y: torch.Tensor, x: torch.Tensor, w: LoRAWeights, passes: tuple[LoRAMetadata, ...]
) -> None:
    backend.apply_paged(y, x, w.lora_a, w.lora_b, w.scales, w.slice_sizes, passes)


def _check(
    pass_slots: list[list[int]], layout: str, dtype: torch.dtype, mode: LoRAKernelMode, seed: int, what: str
) -> None:
    """Fused Triton apply_paged vs float64 naive math and the portable per-pass loop."""
    num_tokens = len(pass_slots[0])
    x, y, w = _setup(num_tokens, layout, dtype, seed)
    passes = _passes(pass_slots)
    expected = y.double().cpu() + sum(naive_lora_delta(x, w, slots) for slots in pass_slots)
    reference = y.clone()
    _apply_paged(PortableLoRABackend(), reference, x, w, passes)
    _apply_paged(TritonLoRABackend(mode), y, x, w, passes)
    assert_close(y, expected, dtype, what)
    assert_close(y, reference.double(), dtype, f"{what} vs the portable per-pass loop")


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- results ---------------------------------------------------------------------------


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_paged_apply_fp32(batch: str) -> None:
    adapters = BATCHES[batch]
    _check(_pass_slots(adapters), "qkv", torch.float32, "auto", seed=1, what=f"paged {batch}")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_dtype_id)
def test_paged_apply_half(dtype: torch.dtype) -> None:
    _check(_pass_slots(MIXED), "qkv", dtype, "auto", seed=2, what=f"paged mixed {_dtype_id(dtype)}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bgmv", "sgmv"])
def test_paged_apply_forced_family(mode: LoRAKernelMode) -> None:
    # One family for every token: SGMV over runs of 1 token, BGMV over prefill runs.
    _check(_pass_slots(MIXED), "qkv", torch.float32, mode, seed=3, what=f"paged mixed, {mode} only")


def test_paged_apply_gate_up() -> None:
    _check(_pass_slots(MIXED), "gate_up", torch.float32, "auto", seed=4, what="paged gate_up")


def test_paged_apply_pages_not_from_the_front() -> None:
    """Passes the engine does not build (a token with page -1 in pass 0 but a page in pass 1,
    later passes cut where pass 0 does not) still give the sum of the passes' deltas."""
    pass0 = [3, -1, 0, 0, 0, -1, 7, 7] + [4] * 20
    pass1 = [-1, 6, 6, 0, 1, 1, -1, 2] + [1] * 16 + [-1] * 4
    _check([pass0, pass1], "qkv", torch.float32, "auto", seed=5, what="paged, gaps")


def test_paged_apply_without_pages_is_a_no_op() -> None:
    x, y, w = _setup(6, "qkv", torch.float32, seed=6)
    before = y.clone()
    _apply_paged(TritonLoRABackend(), y, x, w, _passes([[-1] * 6, [-1] * 6]))
    _apply_paged(TritonLoRABackend(), y, x, w, ())
    assert torch.equal(y, before)


@pytest.mark.parametrize("family", ["bgmv", "sgmv"])
def test_paged_shrink_split_k(family: str) -> None:
    # The atomic (split-K) path: each token's rank row j*P..(j+1)*P is its page j's shrink.
    adapters = DECODE if family == "bgmv" else PREFILL
    pass_slots = _pass_slots(adapters)
    x, _, w = _setup(len(adapters), "qkv", torch.float32, seed=7)
    starts, pages = page_segments(_passes(pass_slots))
    depth = len(pass_slots)
    table = torch.tensor([list(p) + [-1] * (depth - len(p)) for p in pages], dtype=torch.int32)
    lengths = torch.tensor([b - a for a, b in itertools.pairwise(starts)])
    expected = torch.cat([naive_lora_shrink(x, w, slots) for slots in pass_slots], dim=2)
    for split_k in (1, 2):
        if family == "bgmv":
            out = bgmv_shrink_paged(
                x, w.lora_a, table.repeat_interleave(lengths, 0).to(DEVICE), split_k=split_k
            )
        else:
            seg_starts = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
            out = sgmv_shrink_paged(
                x, w.lora_a, seg_starts, table.to(DEVICE), int(lengths.max()), split_k=split_k
            )
        assert_close(out, expected, torch.float32, f"{family}_shrink_paged split_k={split_k}")


# -- launches ---------------------------------------------------------------------------

_LAUNCHERS = (
    "bgmv_shrink",
    "sgmv_shrink",
    "bgmv_expand",
    "sgmv_expand",
    "bgmv_shrink_paged",
    "sgmv_shrink_paged",
    "bgmv_expand_paged",
    "sgmv_expand_paged",
)


def _count_launches(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count calls of the launchers the backend module calls (each is one kernel launch)."""
    module = sys.modules[TritonLoRABackend.__module__]
    counts: Counter[str] = Counter()
    for name in _LAUNCHERS:
        launcher = getattr(module, name)

        def counted(
            *args: Any, _launcher: Callable[..., Any] = launcher, _name: str = name, **kw: Any
        ) -> Any:
            counts[_name] += 1
            return _launcher(*args, **kw)

        monkeypatch.setattr(module, name, counted)
    return counts


@pytest.mark.slow
def test_fused_path_launches_once_per_family(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three passes over decodes and prefill runs: one paged shrink and one paged expand per
    family, where the per-pass loop launches each plain kernel once per pass."""
    counts = _count_launches(monkeypatch)
    pass_slots = _pass_slots(MIXED)
    assert len(pass_slots) == 3
    passes = _passes(pass_slots)
    x, y, w = _setup(len(MIXED), "qkv", torch.float32, seed=8)
    expected = y.double().cpu() + sum(naive_lora_delta(x, w, slots) for slots in pass_slots)
    backend = TritonLoRABackend()

    fused = y.clone()
    _apply_paged(backend, fused, x, w, passes)
    assert counts == Counter(
        bgmv_shrink_paged=1, sgmv_shrink_paged=1, bgmv_expand_paged=1, sgmv_expand_paged=1
    )
    assert_close(fused, expected, torch.float32, "fused passes")

    counts.clear()
    looped = y.clone()
    LoRABackend.apply_paged(backend, looped, x, w.lora_a, w.lora_b, w.scales, w.slice_sizes, passes)
    assert counts == Counter(bgmv_shrink=3, sgmv_shrink=3, bgmv_expand=3, sgmv_expand=3)
    assert_close(fused, looped.double(), torch.float32, "fused vs the per-pass loop")


def test_one_pass_takes_the_plain_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every adapter within one page (ranks 4 and 8): ``apply`` as before, no paged kernel."""
    counts = _count_launches(monkeypatch)
    adapters = [0, 1, -1, 1, 0] + [1] * 16
    pass_slots = _pass_slots(adapters)
    assert len(pass_slots) == 1
    x, y, w = _setup(len(adapters), "qkv", torch.float32, seed=9)
    expected = y.double().cpu() + naive_lora_delta(x, w, pass_slots[0])
    _apply_paged(TritonLoRABackend(), y, x, w, _passes(pass_slots))
    assert counts == Counter(bgmv_shrink=1, sgmv_shrink=1, bgmv_expand=1, sgmv_expand=1)
    assert_close(y, expected, torch.float32, "one pass")


@pytest.mark.slow
def test_paged_plan_is_built_once_per_passes_tuple(monkeypatch: pytest.MonkeyPatch) -> None:
    """One passes tuple serves two projections (q/k/v, gate/up) with one plan; a new tuple
    (a new step) gets a new one."""
    backend = TritonLoRABackend()
    built: list[int] = []
    plan_for = backend._paged_plan_for

    def counted(passes: tuple[LoRAMetadata, ...]) -> Any:
        built.append(len(passes))
        return plan_for(passes)

    monkeypatch.setattr(backend, "_paged_plan_for", counted)
    pass_slots = _pass_slots(DECODE)
    for passes in (_passes(pass_slots), _passes(pass_slots)):
        for seed, layout in enumerate(("qkv", "gate_up")):
            x, y, w = _setup(len(DECODE), layout, torch.float32, seed=10 + seed)
            expected = y.double().cpu() + sum(naive_lora_delta(x, w, slots) for slots in pass_slots)
            _apply_paged(backend, y, x, w, passes)
            assert_close(y, expected, torch.float32, f"{layout} with a cached plan")
    assert built == [3, 3]


# -- the plan (host only) ---------------------------------------------------------------


def test_page_segments_merge_passes() -> None:
    cpu = torch.device("cpu")
    # Two sequences of one adapter side by side (one run), a base-only token, a rank-8 run.
    pass0 = LoRAMetadata.from_segments([0, 3, 5, 6, 10], [4, 4, -1, 7], cpu)
    pass1 = LoRAMetadata.from_segments([0, 5, 6, 10], [1, -1, -1], cpu)
    pass2 = LoRAMetadata.from_segments([0, 2, 5, 10], [2, 2, -1], cpu)
    starts, pages = page_segments((pass0, pass1, pass2))
    assert starts == [0, 5, 6, 10]
    assert pages == [(4, 1, 2), (), (7,)]
    # A pass cutting inside another's run splits it; gaps in a token's passes close up.
    gap = LoRAMetadata.from_token_slots([-1, 6, 6, 6], cpu)
    starts, pages = page_segments((LoRAMetadata.from_token_slots([3, 3, 3, 0], cpu), gap))
    assert starts == [0, 1, 3, 4] and pages == [(3,), (3, 6), (0, 6)]
    assert page_segments(()) == ([0], [])


def test_paged_plan_tables() -> None:
    cpu = torch.device("cpu")
    adapters = [3, 0, -1, 2] + [2] * 16 + [-1, 3]
    passes = tuple(LoRAMetadata.from_token_slots(s, cpu) for s in _pass_slots(adapters))
    plan = TritonLoRABackend("auto")._paged_plan_for(passes)
    assert plan.max_pages == 3 and plan.max_seg_len == 17
    assert plan.bgmv_pages is not None and plan.sgmv_pages is not None and plan.sgmv_starts is not None
    none = [-1, -1, -1]
    # Decodes in BGMV's table; the rank-16 run (token 3 and the next 16: 17 tokens) in SGMV's.
    assert plan.bgmv_pages.tolist() == [[4, 1, 2], [3, -1, -1], none] + [none] * 17 + [none, [4, 1, 2]]
    assert plan.sgmv_starts.tolist() == [0, 1, 2, 3, 20, 21, 22]
    assert plan.sgmv_pages.tolist() == [none, none, none, [0, 6, -1], none, none]
    forced = TritonLoRABackend("bgmv")._paged_plan_for(passes)
    assert forced.sgmv_pages is None and forced.bgmv_pages is not None
    assert forced.bgmv_pages[3:20].tolist() == [[0, 6, -1]] * 17
