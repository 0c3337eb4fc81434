"""Handles of transfers between the tiers and the device: a promotion in flight, a swapped sequence.

``Promotion``: blocks coming back from host/disk into fresh device blocks, what
``TierManager.prefetch`` / ``swap_in`` return, used in three steps so that disk
reads overlap the step's planning and nothing evicts the blocks on their way up::

    promotion = tiers.prefetch(keys)     host slots pinned, disk reads started, keys hidden
    block_ids = <allocate promotion.num_started device blocks, or fewer>
    promotion.assign(block_ids)          host copies issued now (DMA on CUDA)
    result = promotion.wait()            before the forward: disk blocks written; blocks
                                         block_ids[:result.num_loaded] hold their data

The chain stops at the first block that could not be loaded (a failed disk read is a
counted miss, never a hit); what follows stays where it was (for swap-in: is freed).
``cancel()`` instead of ``wait()`` loads nothing.

``SwapHandle``: a preempted sequence's blocks (full or partial) held by the tiers
under private keys, 16 bytes long, so never equal to a 32-byte prefix-cache key.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

logger = logging.getLogger(__name__)

_SWAP_TAG = b"swap"
_SWAP_KEY = struct.Struct("<4sQI")


@dataclass(frozen=True)
class SwapHandle:
    """A preempted sequence's blocks held by the tiers; give it back to ``swap_in`` or ``discard_swap``."""

    swap_id: int
    num_blocks: int

    def block_keys(self) -> list[bytes]:
        """The private keys its blocks are stored under, in order."""
        return [_SWAP_KEY.pack(_SWAP_TAG, self.swap_id, i) for i in range(self.num_blocks)]


def is_swap_key(key: bytes) -> bool:
    return len(key) == _SWAP_KEY.size and key.startswith(_SWAP_TAG)


def read_result(read: Future[torch.Tensor | None]) -> torch.Tensor | None:
    """A disk read's block, or None; the pool counted every I/O fault as a miss already."""
    exc = read.exception()
    if exc is not None:  # not an I/O fault (those come back as None): a bug, but still a miss
        logger.error("disk KV read failed unexpectedly", exc_info=exc)
        return None
    return read.result()


class PromotionResult(NamedTuple):
    """What a promotion loaded: ``block_ids[i]`` holds ``keys[i]``'s data, for each i."""

    num_loaded: int
    num_requested: int
    keys: list[bytes]  # the loaded keys, in chain order
    block_ids: list[int]  # the device blocks they landed in

    @property
    def complete(self) -> bool:
        return self.num_loaded == self.num_requested


def _NOTHING_LOADED(num_requested: int) -> PromotionResult:
    return PromotionResult(num_loaded=0, num_requested=num_requested, keys=[], block_ids=[])


class PromotionSource(NamedTuple):
    """Where one block of a promotion comes from."""

    key: bytes
    host_slot: int | None  # a host block: the slot, pinned until the promotion ends
    read: Future[torch.Tensor | None] | None  # a disk block: its read on the I/O workers
    owner: bytes = b""  # whose block (the tenant's cache salt), kept on the device too


class PromotionMover(Protocol):
    """What a ``Promotion`` calls back to move its blocks (``promoter.Promoter`` implements it).

    A protocol rather than an import of the promoter, so that ``promoter`` imports this
    module and not the other way round (no import cycle inside ``storage.kv.tiers``).
    """

    def copy_host_sources(self, promotion: Promotion) -> None:
        """Issue the host -> device copies of ``promotion``'s assigned blocks."""
        ...

    def complete_promotion(
        self, promotion: Promotion, timeout_s: float | None, cancel: bool
    ) -> PromotionResult:
        """Wait for the disk reads, write the blocks that loaded, settle what stays below."""
        ...


class Promotion:
    """Blocks on their way up; ``assign`` device blocks, then ``wait`` (or ``cancel``) once."""

    def __init__(
        self, mover: PromotionMover, sources: list[PromotionSource], num_requested: int, keep_unloaded: bool
    ) -> None:
        self._mover = mover
        self.sources = sources
        self.num_requested = num_requested
        self.keep_unloaded = keep_unloaded  # False for swap-in: what is not loaded is freed
        self.block_ids: list[int] | None = None
        self._result: PromotionResult | None = None

    @property
    def num_started(self) -> int:
        """Leading keys held by host or disk when the promotion started: allocate this many blocks."""
        return len(self.sources)

    @property
    def keys(self) -> list[bytes]:
        return [s.key for s in self.sources]

    @property
    def owners(self) -> list[bytes]:
        """The owner of each key in ``keys`` (b"": nobody's)."""
        return [s.owner for s in self.sources]

    def assign(self, block_ids: Sequence[int]) -> None:
        """The fresh device blocks for the first ``len(block_ids)`` keys; host copies start now."""
        if self.block_ids is not None:
            raise RuntimeError("device blocks were already assigned to this promotion")
        if len(block_ids) > self.num_started:
            raise ValueError(f"{len(block_ids)} device blocks for {self.num_started} started keys")
        self.block_ids = list(block_ids)
        self._mover.copy_host_sources(self)

    def done(self) -> bool:
        """True if ``wait`` would not block on disk reads."""
        return all(s.read is None or s.read.done() for s in self.sources)

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until the disk reads are done (or ``timeout_s`` passed); True if they are.

        Finishes nothing: ``wait`` (or ``cancel``) must still follow.
        """
        reads = [s.read for s in self.sources if s.read is not None]
        _, not_done = wait_futures(reads, timeout=timeout_s)
        return not not_done

    def wait(self, timeout_s: float | None = None) -> PromotionResult:
        """Finish the transfers (before the forward that reads the blocks).

        Raises TimeoutError if disk reads are still running after ``timeout_s`` (wait
        again later). The caller publishes ``result.block_ids`` in its prefix cache
        and releases the other assigned blocks. Any other error (a device copy that
        failed) ends the promotion with nothing loaded before it is raised: the caller
        releases every assigned block.
        """
        if self._result is None:
            if self.block_ids is None:
                raise RuntimeError("assign device blocks before waiting for a promotion")
            try:
                self._result = self._mover.complete_promotion(self, timeout_s, cancel=False)
            except TimeoutError:
                raise  # nothing was finished: wait again later
            except BaseException:
                self._result = _NOTHING_LOADED(self.num_requested)
                raise
        return self._result

    def cancel(self) -> None:
        """Load nothing: every block stays in its tier (a swap-in's blocks are freed)."""
        if self._result is None:
            self._result = self._mover.complete_promotion(self, None, cancel=True)
