"""``LoRABackend`` on the Triton kernels: BGMV for decode tokens, SGMV for prefill runs.

A flat batch holds decode tokens (runs of one or a few tokens per adapter) and
prefill chunks (long runs of one adapter). Runs shorter than ``SGMV_MIN_RUN``
tokens go through the per-token BGMV kernels, longer ones through the per-segment
SGMV kernels, which read an adapter's weights once per tile of 16-64 tokens. When a
batch has both, each kernel gets a copy of the slot indices with the other kind's
tokens masked to -1, built once per ``LoRAMetadata`` (every projection of every
layer reuses it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from loraplex.kernels.contracts import LoRABackend
from loraplex.kernels.metadata import LoRAMetadata
from loraplex.kernels.step_cache import IdentityCache
from loraplex.kernels.triton.lora_expand import bgmv_expand, sgmv_expand
from loraplex.kernels.triton.lora_shrink import bgmv_shrink, sgmv_shrink

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
