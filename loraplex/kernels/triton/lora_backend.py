"""``LoRABackend`` on the Triton kernels: BGMV for decode tokens, SGMV for prefill runs.

A flat batch holds decode tokens (runs of one or a few tokens per adapter) and
prefill chunks (long runs of one adapter). Runs shorter than ``SGMV_MIN_RUN``
tokens go through the per-token BGMV kernels, longer ones through the per-segment
SGMV kernels, which read an adapter's weights once per tile of 16-64 tokens. When a
batch has both, each kernel gets a copy of the slot indices with the other kind's
tokens masked to -1, built once per ``LoRAMetadata`` (every projection of every
layer reuses it).

Paged adapters (``apply_paged``): an adapter of rank r sits in ``ceil(r / P)`` pages and
the engine hands over one ``LoRAMetadata`` per page pass. With one pass (every rank
<= P) that is ``apply``, unchanged. With more, the passes become one page table per
kernel family, built once per passes tuple (``_PagedPlan``): a row per token (BGMV)
or per segment (SGMV) listing its adapter's pages, -1 padded to the deepest adapter.
The paged kernels take every page of a row in one program (rank row ``r`` of the
``[slices, tokens, max_pages * P]`` rank buffer belongs to page ``r // P``), so a
projection costs one shrink and one expand launch per family used, whatever the ranks,
instead of one pair per pass.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

import torch

from loraplex.kernels.contracts import LoRABackend
from loraplex.kernels.metadata import LoRAMetadata
from loraplex.kernels.step_cache import IdentityCache
from loraplex.kernels.triton.lora_expand import bgmv_expand, bgmv_expand_paged, sgmv_expand, sgmv_expand_paged
from loraplex.kernels.triton.lora_shrink import bgmv_shrink, bgmv_shrink_paged, sgmv_shrink, sgmv_shrink_paged

# Runs this long fill an SGMV tile (tl.dot needs >= 16 rows); shorter ones are decodes.
SGMV_MIN_RUN = 16

LoRAKernelMode = Literal["auto", "bgmv", "sgmv"]


@dataclass(frozen=True)
class _LaunchPlan:
    """Which tokens each kernel serves; ``None`` means that kernel is not launched."""

    bgmv_slots: torch.Tensor | None  # [num_tokens] int32, -1 where SGMV serves the token
    sgmv_starts: torch.Tensor | None  # [num_segments + 1] int32
    sgmv_slots: torch.Tensor | None  # [num_segments] int32, -1 where BGMV serves the run
    max_seg_len: int


@dataclass(frozen=True)
class _PagedPlan:
    """Page tables of one step's passes of one group; ``None`` means that kernel is not launched.

    Rows list their pages first, then -1; a row whose first entry is -1 has no adapter
    (or is served by the other family).
    """

    max_pages: int  # columns of the tables; 0: no token has a page (nothing to launch)
    bgmv_pages: torch.Tensor | None  # [num_tokens, max_pages] int32
    sgmv_starts: torch.Tensor | None  # [num_segments + 1] int32
    sgmv_pages: torch.Tensor | None  # [num_segments, max_pages] int32
    max_seg_len: int  # longest segment SGMV serves


def page_segments(passes: tuple[LoRAMetadata, ...]) -> tuple[list[int], list[tuple[int, ...]]]:
    """The passes as one segmentation: ``(starts, pages)``, tokens ``starts[g]:starts[g + 1]``
    using pages ``pages[g]`` (pass order, -1 dropped; empty: no adapter).

    Segments are cut wherever any pass cuts (in the engine, pass 0's runs, since a later
    pass gives a run page i of the same adapter), then neighbours with equal page lists
    merge. O(segments * passes) on the host copies, no device sync when they are present.
    """
    views: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for meta in passes:
        starts = meta.seg_starts_cpu or tuple(meta.seg_starts.tolist())
        slots = meta.seg_slots_cpu or tuple(meta.seg_slots.tolist())
        views.append((starts, slots))
    num_tokens = max((v[0][-1] for v in views), default=0)
    cuts = sorted({b for starts, _ in views for b in starts} | {0, num_tokens})
    out_starts: list[int] = [0]
    out_pages: list[tuple[int, ...]] = []
    cursor = [0] * len(views)  # per pass, the segment holding the current token
    for lo, hi in itertools.pairwise(cuts):
        pages: list[int] = []
        for i, (starts, slots) in enumerate(views):
            while cursor[i] < len(slots) and starts[cursor[i] + 1] <= lo:
                cursor[i] += 1
            if cursor[i] < len(slots) and slots[cursor[i]] >= 0:
                pages.append(slots[cursor[i]])
        row = tuple(pages)
        if out_pages and out_pages[-1] == row:
            out_starts[-1] = hi
        else:
            out_pages.append(row)
            out_starts.append(hi)
    if not out_pages:
        out_starts = [0]
    return out_starts, out_pages


class TritonLoRABackend(LoRABackend):
    """Batched multi-adapter LoRA on Triton kernels.

    ``mode`` forces one kernel family for every token ("bgmv" or "sgmv"; tests use
    this), or lets run lengths decide ("auto").
    """

    name = "triton"

    def __init__(self, mode: LoRAKernelMode = "auto") -> None:
        if mode not in ("auto", "bgmv", "sgmv"):
            raise ValueError(f"unknown LoRA kernel mode {mode!r}; choose 'auto', 'bgmv' or 'sgmv'")
        self.mode: LoRAKernelMode = mode
        # The same metadata object serves every layer of a step: plan it once.
        self._plans: IdentityCache[LoRAMetadata, _LaunchPlan] = IdentityCache()
        # The same passes tuple serves one group in every layer of a step: tabulate it once.
        self._paged_plans: IdentityCache[tuple[LoRAMetadata, ...], _PagedPlan] = IdentityCache()

    def _launch_plan(self, meta: LoRAMetadata) -> _LaunchPlan:
        return self._plans.get(meta, self._plan_for)

    def _plan_for(self, meta: LoRAMetadata) -> _LaunchPlan:
        starts = list(meta.seg_starts_cpu or meta.seg_starts.tolist())
        slots = list(meta.seg_slots_cpu or meta.seg_slots.tolist())
        lengths = [starts[i + 1] - starts[i] for i in range(len(slots))]
        max_seg_len = max(lengths, default=0)
        device = meta.token_slots.device
        if self.mode == "bgmv":
            plan = _LaunchPlan(meta.token_slots, None, None, max_seg_len)
        elif self.mode == "sgmv":
            plan = _LaunchPlan(None, meta.seg_starts, meta.seg_slots, max_seg_len)
        else:
            is_long = [n >= SGMV_MIN_RUN and s >= 0 for n, s in zip(lengths, slots, strict=True)]
            is_short = [n < SGMV_MIN_RUN and s >= 0 for n, s in zip(lengths, slots, strict=True)]
            if not any(is_long):
                plan = _LaunchPlan(meta.token_slots, None, None, max_seg_len)
            elif not any(is_short):
                plan = _LaunchPlan(None, meta.seg_starts, meta.seg_slots, max_seg_len)
            else:
                token_slots: list[int] = []
                for n, s, long_run in zip(lengths, slots, is_long, strict=True):
                    token_slots += [-1 if long_run else s] * n
                long_slots = [s if long_run else -1 for s, long_run in zip(slots, is_long, strict=True)]
                plan = _LaunchPlan(
                    torch.tensor(token_slots, dtype=torch.int32, device=device),
                    meta.seg_starts,
                    torch.tensor(long_slots, dtype=torch.int32, device=device),
                    max(n for n, long_run in zip(lengths, is_long, strict=True) if long_run),
                )
        return plan

    def shrink(
        self,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        meta: LoRAMetadata,
    ) -> torch.Tensor:
        """Rank-space projection as float32 ``[num_slices, num_tokens, max_rank]``."""
        plan = self._launch_plan(meta)
        num_slices, _, max_rank, _ = lora_a.shape
        out = torch.zeros(num_slices, x.shape[0], max_rank, dtype=torch.float32, device=x.device)
        if plan.bgmv_slots is not None:
            bgmv_shrink(x, lora_a, plan.bgmv_slots, out=out)
        if plan.sgmv_slots is not None and plan.sgmv_starts is not None:
            sgmv_shrink(x, lora_a, plan.sgmv_starts, plan.sgmv_slots, plan.max_seg_len, out=out)
        return out

    def expand(
        self,
        y: torch.Tensor,
        x_rank: torch.Tensor,
        lora_b: torch.Tensor,
        scales: torch.Tensor,
        slice_sizes: tuple[int, ...],
        meta: LoRAMetadata,
    ) -> None:
        plan = self._launch_plan(meta)
        if plan.bgmv_slots is not None:
            bgmv_expand(y, x_rank, lora_b, scales, slice_sizes, plan.bgmv_slots)
        if plan.sgmv_slots is not None and plan.sgmv_starts is not None:
            sgmv_expand(
                y, x_rank, lora_b, scales, slice_sizes, plan.sgmv_starts, plan.sgmv_slots, plan.max_seg_len
            )

    # -- paged adapters: every pass in one launch per kernel family ------------------------

    def _paged_plan_for(self, passes: tuple[LoRAMetadata, ...]) -> _PagedPlan:
        starts, pages = page_segments(passes)
        max_pages = max((len(p) for p in pages), default=0)
        if max_pages == 0:
            return _PagedPlan(0, None, None, None, 0)
        device = passes[0].token_slots.device
        lengths = [b - a for a, b in itertools.pairwise(starts)]
        rows = [list(p) + [-1] * (max_pages - len(p)) for p in pages]
        none = [-1] * max_pages

        def table(keep: list[bool]) -> torch.Tensor:  # [num_segments, max_pages], -1 where not kept
            return torch.tensor(
                [r if k else none for r, k in zip(rows, keep, strict=True)], dtype=torch.int32
            )

        def token_table(keep: list[bool]) -> torch.Tensor:  # a segment's row for each of its tokens
            return table(keep).repeat_interleave(torch.tensor(lengths), dim=0).to(device)

        def segment_table(keep: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.tensor(starts, dtype=torch.int32, device=device), table(keep).to(device)

        has_pages = [bool(p) for p in pages]
        if self.mode == "bgmv":
            return _PagedPlan(max_pages, token_table(has_pages), None, None, 0)
        if self.mode == "sgmv":
            seg_starts, seg_pages = segment_table(has_pages)
            max_seg_len = max(n for n, h in zip(lengths, has_pages, strict=True) if h)
            return _PagedPlan(max_pages, None, seg_starts, seg_pages, max_seg_len)
        is_long = [n >= SGMV_MIN_RUN and h for n, h in zip(lengths, has_pages, strict=True)]
        is_short = [n < SGMV_MIN_RUN and h for n, h in zip(lengths, has_pages, strict=True)]
        bgmv_pages = token_table(is_short) if any(is_short) else None
        if not any(is_long):
            return _PagedPlan(max_pages, bgmv_pages, None, None, 0)
        seg_starts, seg_pages = segment_table(is_long)
        max_seg_len = max(n for n, long_run in zip(lengths, is_long, strict=True) if long_run)
        return _PagedPlan(max_pages, bgmv_pages, seg_starts, seg_pages, max_seg_len)

    def apply_paged(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scales: torch.Tensor,
        slice_sizes: tuple[int, ...],
        passes: tuple[LoRAMetadata, ...],
    ) -> None:
        """Every page pass in one shrink and one expand launch per kernel family.

        One pass (every adapter within one page) is ``apply``, exactly as before; deeper
        passes go through the paged kernels over the plan's page tables.
        """
        if not passes:
            return
        if len(passes) == 1:
            self.apply(y, x, lora_a, lora_b, scales, slice_sizes, passes[0])
            return
        plan = self._paged_plans.get(passes, self._paged_plan_for)
        if plan.max_pages == 0:
            return
        num_slices, _, page_rank, _ = lora_a.shape
        x_rank = torch.zeros(
            num_slices, x.shape[0], plan.max_pages * page_rank, dtype=torch.float32, device=x.device
        )
        if plan.bgmv_pages is not None:
            bgmv_shrink_paged(x, lora_a, plan.bgmv_pages, out=x_rank)
        if plan.sgmv_pages is not None and plan.sgmv_starts is not None:
            sgmv_shrink_paged(x, lora_a, plan.sgmv_starts, plan.sgmv_pages, plan.max_seg_len, out=x_rank)
        if plan.bgmv_pages is not None:
            bgmv_expand_paged(y, x_rank, lora_b, scales, slice_sizes, plan.bgmv_pages)
        if plan.sgmv_pages is not None and plan.sgmv_starts is not None:
            sgmv_expand_paged(
                y, x_rank, lora_b, scales, slice_sizes, plan.sgmv_starts, plan.sgmv_pages, plan.max_seg_len
            )
