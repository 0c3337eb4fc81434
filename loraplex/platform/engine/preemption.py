"""What happens to a preempted sequence's KV: swap its unshared tail out, or recompute it.

With the prefix cache on, every full block a sequence has computed carries a key, so
preemption never loses those: freed, they stay findable on the device until reused,
are demoted to host (then disk) when the pool reuses them, and come back on resume
by the prefix lookup and promotion, like any other cached prefix. What has no key is
the partial last block (up to ``block_size - 1`` tokens, including generated ones).
``preemption_mode`` decides its fate:

    recompute   drop it; on resume those tokens are computed again
    swap        copy it to the host tier (else disk) under a private key
                (``TierManager.swap_out``) and write it back into a fresh device block
                on resume (``swap_in``), so no token is recomputed
    auto        swap when moving the block's bytes out and back costs less than
                recomputing its tokens, by the engine's measured rates (below);
                recompute when there is no host or disk tier

The cost model: ``seconds_per_token`` is an exponential moving average of step time
over tokens computed (the engine reports every step), ``copy_bytes_per_s`` one of the
swap copies' measured throughput (a conservative 2 GB/s until the first copy). On a
CPU, recomputing a token of a 135M-parameter model costs ~1 ms and moving one 0.7 MB
block ~0.1 ms, so ``auto`` swaps; on a GPU, where a token in a batch costs
microseconds, it may recompute.

If a full block before the tail was lost meanwhile (evicted from every tier), the
swapped tail is useless (tokens must be contiguous) and is discarded: the sequence
recomputes from its longest surviving prefix. A failed or lost swap-in is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from loraplex.storage.kv.tiers.transfers import Promotion, SwapHandle

PreemptionMode = Literal["auto", "recompute", "swap"]
PREEMPTION_MODES: tuple[PreemptionMode, ...] = ("auto", "recompute", "swap")

_DEFAULT_COPY_BYTES_PER_S = 2e9
_EMA = 0.2  # weight of the newest observation


@dataclass
class SwappedTail:
    """A preempted sequence's unshared blocks, held by the tiers until it resumes."""

    handle: SwapHandle
    first_block: int  # table index of the first swapped block (the full blocks before it are cached)
    num_computed_tokens: int  # what the sequence had computed when it was preempted
    swap_in: Promotion | None = None  # started when the sequence is next considered for admission

    @property
    def num_blocks(self) -> int:
        return self.handle.num_blocks


class PreemptionPolicy:
    """Chooses swap or recompute for each preemption (``preemption_mode`` plus the cost model)."""

    def __init__(self, mode: PreemptionMode, bytes_per_block: int, can_swap: bool) -> None:
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {mode!r}")
        if mode == "swap" and not can_swap:
            raise ValueError("preemption_mode='swap' needs a host or disk KV tier to swap to")
        self.mode: PreemptionMode = mode
        self.bytes_per_block = bytes_per_block
        self.can_swap = can_swap
        self.seconds_per_token: float | None = None
        self.copy_bytes_per_s = _DEFAULT_COPY_BYTES_PER_S

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step computed ``num_tokens`` tokens in ``seconds``."""
        if num_tokens <= 0 or seconds <= 0:
            return
        rate = seconds / num_tokens
        prev = self.seconds_per_token
        self.seconds_per_token = rate if prev is None else (1 - _EMA) * prev + _EMA * rate

    def observe_copy(self, num_blocks: int, seconds: float) -> None:
        """A swap copy moved ``num_blocks`` blocks in ``seconds``."""
        if num_blocks <= 0 or seconds <= 0:
            return
        rate = num_blocks * self.bytes_per_block / seconds
        self.copy_bytes_per_s = (1 - _EMA) * self.copy_bytes_per_s + _EMA * rate

    def swap_cost_s(self, num_blocks: int) -> float:
        """Estimated seconds to copy ``num_blocks`` out now and back on resume."""
        return 2 * num_blocks * self.bytes_per_block / self.copy_bytes_per_s

    def recompute_cost_s(self, num_tokens: int) -> float | None:
        """Estimated seconds to compute ``num_tokens`` again (None before the first step)."""
        return None if self.seconds_per_token is None else num_tokens * self.seconds_per_token

    def should_swap(self, num_tokens: int, num_blocks: int) -> bool:
        """Swap ``num_blocks`` blocks holding ``num_tokens`` uncached tokens, or recompute them?"""
        if num_blocks <= 0 or num_tokens <= 0 or not self.can_swap or self.mode == "recompute":
            return False
        if self.mode == "swap":
            return True
        recompute = self.recompute_cost_s(num_tokens)
        return recompute is not None and self.swap_cost_s(num_blocks) < recompute
