"""``LoRABackend`` in plain PyTorch: batched multi-adapter LoRA that runs anywhere, tuned for the CPU.

The engine calls ``apply`` in every projection of every layer, so op count matters
as much as FLOPs: a per-token or per-slot Python loop would cost more than the
matmuls on a decode batch. Tokens are therefore grouped once per ``LoRAMetadata``
(the same object serves a whole step) into:

* direct runs: a run of >= ``DIRECT_MIN_RUN`` consecutive tokens on one adapter
  (a prefill chunk) is served on views, ``y[run] += (x[run] @ A^T) @ B^T``, with
  no gather and no scatter;
* buckets: the remaining tokens (decodes, short chunks) grouped by slot, padded to
  a common group length and served by one gather of x, batched matmuls for the
  shrink and per slice for the expand, and one ``index_add_`` of whole rows into y.
  Groups are bucketed by length so one long group does not pad all the others to
  its length, but every bucket costs about a dozen ops, so buckets are chosen by a
  small cost model (``plan_buckets``: a padded row vs a bucket's op overhead).
  When a bucket's slots (nearly) form a range, A and B are read through views;
  otherwise the active adapters' rows are gathered.

Padded rows read token 0 and are zeroed before the expand (their rank vector is
multiplied by a 0 mask folded into the scale), so they add exactly 0 to token 0.

``shrink`` returns float32 ``[num_slices, num_tokens, max_rank]`` like the Triton
backend; ``apply`` skips that token-order tensor and goes group to group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels.contracts import LoRABackend
from loraplex.kernels.metadata import LoRAMetadata
from loraplex.kernels.step_cache import IdentityCache

# Runs at least this long are prefill chunks served on views; shorter runs are batched.
DIRECT_MIN_RUN = 16

# What one more bucket costs, in padded rows. A bucket is ~12 torch ops (~6-8 us each
# on the CPU); a padded row costs a shrink + expand of rank 16 on SmolLM2-sized
# projections (~80 kFLOP, ~2 us in these thin batched matmuls). On decode batches of
# 64-128 tokens over 16-32 power-law adapters this plans 3 buckets where power-of-two
# lengths made 5-7, and the four projections of a layer take 20-30% less time.
BUCKET_COST_ROWS = 32


@dataclass(frozen=True)
class Run:
    """Consecutive tokens ``start:end`` on adapter ``slot``."""

    slot: int
    start: int
    end: int


@dataclass(frozen=True)
class _Bucket:
    """Groups of tokens (one group per slot) padded to ``group_len`` rows each."""

    slots: torch.Tensor  # [num_groups] int64, the slot of each group
    gather_index: torch.Tensor  # [num_groups * group_len] int64, padding reads token 0
    scatter_index: torch.Tensor  # [num_groups * group_len] int64, padding writes row num_tokens
    valid: torch.Tensor | None  # [num_groups, group_len, 1] float32; None when nothing is padded
    num_groups: int
    group_len: int
    # Set when the groups are exactly slots lo, lo + 1, ..., hi - 1: the weights are then
    # read through views, with no copy of the active adapters.
    slot_range: tuple[int, int] | None


@dataclass(frozen=True)
class _Grouping:
    runs: tuple[Run, ...]
    buckets: tuple[_Bucket, ...]


def _make_bucket(groups: list[tuple[int, list[int]]], num_tokens: int, device: torch.device) -> _Bucket:
    """Pad ``(slot, tokens)`` groups (sorted by slot) into one bucket.

    If the slots nearly form a range (at most half as many holes as groups), the holes
    become empty groups: their padded rows cost a little compute, while reading the
    weights through a range view saves copying every active adapter's A and B.
    """
    lo, hi = groups[0][0], groups[-1][0] + 1
    slot_range: tuple[int, int] | None = None
    if hi - lo <= len(groups) + len(groups) // 2:
        present = dict(groups)
        groups = [(slot, present.get(slot, [])) for slot in range(lo, hi)]
        slot_range = (lo, hi)
    group_len = max(len(tokens) for _, tokens in groups)
    gather: list[int] = []
    scatter: list[int] = []
    valid: list[float] = []
    for _, tokens in groups:
        pad = group_len - len(tokens)
        gather += tokens + [0] * pad
        scatter += tokens + [num_tokens] * pad
        valid += [1.0] * len(tokens) + [0.0] * pad
    valid_mask = None
    if 0.0 in valid:
        valid_mask = torch.tensor(valid, dtype=torch.float32, device=device).view(len(groups), group_len, 1)
    return _Bucket(
        slots=torch.tensor([slot for slot, _ in groups], dtype=torch.int64, device=device),
        gather_index=torch.tensor(gather, dtype=torch.int64, device=device),
        scatter_index=torch.tensor(scatter, dtype=torch.int64, device=device),
        valid=valid_mask,
        num_groups=len(groups),
        group_len=group_len,
        slot_range=slot_range,
    )


def split_runs(meta: LoRAMetadata) -> tuple[list[Run], dict[int, list[int]]]:
    """Runs of >= ``DIRECT_MIN_RUN`` tokens on one adapter, and the other tokens by slot."""
    starts = list(meta.seg_starts_cpu or meta.seg_starts.tolist())
    seg_slots = list(meta.seg_slots_cpu or meta.seg_slots.tolist())
    runs: list[Run] = []
    short: dict[int, list[int]] = {}
    for i, slot in enumerate(seg_slots):
        lo, hi = starts[i], starts[i + 1]
        if slot < 0 or hi <= lo:
            continue
        if hi - lo >= DIRECT_MIN_RUN:
            runs.append(Run(slot, lo, hi))
        else:
            short.setdefault(slot, []).extend(range(lo, hi))
    return runs, short


def group_tokens(meta: LoRAMetadata, device: torch.device) -> _Grouping:
    """Split a batch into direct runs and length-bucketed slot groups (host-side, once per step)."""
    starts = meta.seg_starts_cpu or tuple(meta.seg_starts.tolist())
    num_tokens = starts[-1] if starts else 0
    runs, short = split_runs(meta)
    groups = sorted(short.items(), key=lambda item: (len(item[1]), item[0]))
    plan = plan_buckets([len(tokens) for _, tokens in groups], BUCKET_COST_ROWS)
    buckets = tuple(
        _make_bucket(sorted(groups[i] for i in range(lo, hi)), num_tokens, device) for lo, hi in plan
    )
    return _Grouping(tuple(runs), buckets)


def plan_buckets(lengths: list[int], bucket_cost: int) -> list[tuple[int, int]]:
    """Split group lengths (sorted ascending) into buckets ``[lo, hi)`` of least cost.

    A bucket pads each of its groups to its longest: it costs ``bucket_cost`` plus
    ``(hi - lo) * lengths[hi - 1]`` rows. Since the lengths are sorted, an optimal
    split is a set of contiguous ranges, and groups of equal length never need to be
    split (that only adds a bucket), so a quadratic DP runs over the distinct lengths:
    at most ~sqrt(2 * num_tokens) of them, however many adapter slots there are.
    """
    # Ends (exclusive) of the runs of equal lengths: the only places a bucket may end.
    ends = [i + 1 for i in range(len(lengths)) if i + 1 == len(lengths) or lengths[i + 1] != lengths[i]]
    bounds = [0, *ends]
    best = [0] * len(bounds)  # best[k]: least cost of the groups before bounds[k]
    cut = [0] * len(bounds)
    for k in range(1, len(bounds)):
        hi = bounds[k]
        best[k], cut[k] = min(
            (best[m] + bucket_cost + (hi - bounds[m]) * lengths[hi - 1], m) for m in range(k)
        )
    plan: list[tuple[int, int]] = []
    k = len(bounds) - 1
    while k > 0:
        plan.append((bounds[cut[k]], bounds[k]))
        k = cut[k]
    return plan[::-1]


def _slice_offsets(slice_sizes: tuple[int, ...]) -> list[int]:
    return [sum(slice_sizes[:i]) for i in range(len(slice_sizes))]


class PortableLoRABackend(LoRABackend):
    """Batched LoRA in plain PyTorch: grouped by slot, no per-token loops; tuned for the CPU."""

    name = "torch"

    def __init__(self) -> None:
        # One LoRAMetadata serves every layer of a step: group its tokens once.
        self._groupings: IdentityCache[LoRAMetadata, _Grouping] = IdentityCache()

    def _group(self, meta: LoRAMetadata, device: torch.device) -> _Grouping:
        return self._groupings.get(meta, lambda m: group_tokens(m, device))

    # -- shrink: rank-space vectors, group by group ------------------------------------

    @staticmethod
    def _shrink_run(x: torch.Tensor, lora_a: torch.Tensor, run: Run) -> torch.Tensor:
        """``[num_slices, run_len, max_rank]`` in x.dtype, one mm for all slices.

        Stacking the slices' A (a copy of one adapter's A, small next to the run's
        rows of x) gives one GEMM of width S * R instead of S GEMMs of width R.
        """
        num_slices, _, max_rank, in_features = lora_a.shape
        a = lora_a[:, run.slot].reshape(num_slices * max_rank, in_features)
        r = x[run.start : run.end] @ a.t()  # [run_len, S * R]
        return r.view(-1, num_slices, max_rank).transpose(0, 1)

    @staticmethod
    def _shrink_bucket(x: torch.Tensor, lora_a: torch.Tensor, bucket: _Bucket) -> torch.Tensor:
        """``[num_slices, num_groups, group_len, max_rank]`` in x.dtype."""
        num_slices, _, max_rank, in_features = lora_a.shape
        xg = x.index_select(0, bucket.gather_index).view(bucket.num_groups, bucket.group_len, in_features)
        if bucket.slot_range is None:
            # Only the active adapters, [S, G, R, in]: a gather along a contiguous tensor's
            # dim 1 is a row copy, several times faster than through a transposed view.
            a = lora_a.index_select(1, bucket.slots)
            return torch.matmul(xg, a.transpose(-1, -2))  # xg broadcast over slices
        lo, hi = bucket.slot_range
        r = torch.empty(
            num_slices, bucket.num_groups, bucket.group_len, max_rank, dtype=x.dtype, device=x.device
        )
        for s in range(num_slices):
            torch.bmm(xg, lora_a[s, lo:hi].transpose(1, 2), out=r[s])
        return r

    def shrink(
        self,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        meta: LoRAMetadata,
    ) -> torch.Tensor:
        """Rank-space projection as float32 ``[num_slices, num_tokens, max_rank]``."""
        grouping = self._group(meta, x.device)
        num_slices, _, max_rank, _ = lora_a.shape
        num_tokens = x.shape[0]
        # Row num_tokens is a sink for the buckets' padding rows.
        out = torch.zeros(num_slices, num_tokens + 1, max_rank, dtype=torch.float32, device=x.device)
        for run in grouping.runs:
            out[:, run.start : run.end] = self._shrink_run(x, lora_a, run)
        for bucket in grouping.buckets:
            r = self._shrink_bucket(x, lora_a, bucket).reshape(num_slices, -1, max_rank)
            out.index_copy_(1, bucket.scatter_index, r.float())
        return out[:, :num_tokens]

    # -- expand: add scale * r @ B^T into each slice's columns ------------------------

    @staticmethod
    def _expand_run(
        y: torch.Tensor,
        r: torch.Tensor,  # [S, run_len, R]
        lora_b: torch.Tensor,
        scales: torch.Tensor,
        slice_sizes: tuple[int, ...],
        run: Run,
    ) -> None:
        r = (r * scales[run.slot]).to(lora_b.dtype)
        for s, (offset, size) in enumerate(zip(_slice_offsets(slice_sizes), slice_sizes, strict=True)):
            y[run.start : run.end, offset : offset + size].addmm_(r[s], lora_b[s, run.slot, :size].t())

    @staticmethod
    def _expand_bucket(
        y: torch.Tensor,
        r: torch.Tensor,  # [S, G, M, R]
        lora_b: torch.Tensor,
        scales: torch.Tensor,
        slice_sizes: tuple[int, ...],
        bucket: _Bucket,
    ) -> None:
        # Scale per group, and zero the padding rows so they add nothing to token 0.
        factor = scales.index_select(0, bucket.slots).view(-1, 1, 1)
        if bucket.valid is not None:
            factor = factor * bucket.valid
        r = (r * factor).to(lora_b.dtype)
        deltas = []
        for s, size in enumerate(slice_sizes):
            if bucket.slot_range is None:
                b = lora_b[s, :, :size].index_select(0, bucket.slots)  # [G, size, R]
            else:
                b = lora_b[s, bucket.slot_range[0] : bucket.slot_range[1], :size]  # a view
            deltas.append(torch.bmm(r[s], b.transpose(1, 2)).view(-1, size))  # [G * M, size]
        if y.is_contiguous():
            # One scatter over whole rows: index_add_ into a column slice of y takes a
            # strided slow path (about 4x slower than rows of a contiguous tensor).
            y.index_add_(0, bucket.gather_index, torch.cat(deltas, dim=1) if len(deltas) > 1 else deltas[0])
            return
        for offset, size, delta in zip(_slice_offsets(slice_sizes), slice_sizes, deltas, strict=True):
            y[:, offset : offset + size].index_add_(0, bucket.gather_index, delta)

    def expand(
        self,
        y: torch.Tensor,
        x_rank: torch.Tensor,
        lora_b: torch.Tensor,
        scales: torch.Tensor,
        slice_sizes: tuple[int, ...],
        meta: LoRAMetadata,
    ) -> None:
        grouping = self._group(meta, y.device)
        num_slices, _, _, max_rank = lora_b.shape
        for run in grouping.runs:
            self._expand_run(y, x_rank[:, run.start : run.end], lora_b, scales, slice_sizes, run)
        for bucket in grouping.buckets:
            r = x_rank.index_select(1, bucket.gather_index)
            r = r.view(num_slices, bucket.num_groups, bucket.group_len, max_rank)
            self._expand_bucket(y, r, lora_b, scales, slice_sizes, bucket)

    def apply(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scales: torch.Tensor,
        slice_sizes: tuple[int, ...],
        meta: LoRAMetadata,
    ) -> None:
        """Shrink and expand group by group, never building the token-order rank tensor."""
        if meta.num_active_slots == 0:
            return
        grouping = self._group(meta, x.device)
        for run in grouping.runs:  # a shrink GEMM, then an expand GEMM per slice, on views
            self._expand_run(y, self._shrink_run(x, lora_a, run), lora_b, scales, slice_sizes, run)
        for bucket in grouping.buckets:
            r = self._shrink_bucket(x, lora_a, bucket)
            self._expand_bucket(y, r, lora_b, scales, slice_sizes, bucket)
