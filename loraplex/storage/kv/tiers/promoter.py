"""The promotions in flight below the device: the keys they hold, and each one's start and end.

``TierManager.prefetch`` / ``swap_in`` start a promotion here; its ``Promotion`` handle
(``transfers``) calls back into the ``Promoter`` to copy and to finish::

    start(keys)              host blocks pinned, disk reads started, keys hidden (*moving*)
    copy_host_sources(p)     on ``assign``: the host -> device copies issued (DMA on CUDA)
    complete_promotion(p)    on ``wait`` / ``cancel``: disk reads waited for, their blocks written,
                             the chain stopped at the first failure; loaded blocks leave
                             host/disk, the rest stay (a swap-in's are freed), keys unhidden
    discard(keys)            the device caches ``keys``: their copies below go, or are marked
                             *superseded* while a promotion moves them

A key being promoted is pinned where it is and hidden from ``lookup`` until ``wait``
decides: loaded blocks leave the lower tier, blocks after a failure stay there
(findable again). The caller publishes the loaded device blocks in its prefix cache
only after ``wait``, so nothing reads a block before its data landed.

The one transient exception to one location: the device may cache a key while a
promotion moves it (another sequence computed it meanwhile). The copy below cannot go
then (pinned, or read by a disk worker), so it is marked *superseded* and dropped when
the promotion ends, unless it loaded (then it leaves anyway, and the promoted block
stays keyless on the device). If the device evicts the key before that, the mark is
lifted (``keep_below``): the copy below is the only one again. ``TierManager.check_integrity``
allows exactly the superseded keys on both sides.

Every method takes the manager's lock (shared, re-entrant); ``complete_promotion`` waits
for disk reads outside it.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from concurrent.futures import wait as wait_futures

import torch

from loraplex.storage.kv.tiers.placement import TierPlacement
from loraplex.storage.kv.tiers.transfers import Promotion, PromotionResult, PromotionSource, read_result


class Promoter:
    """Starts and ends promotions, and keeps the keys they hold (``PromotionMover``)."""

    def __init__(self, lock: threading.RLock, placement: TierPlacement) -> None:
        self._lock = lock  # the manager's
        self._placement = placement
        self.moving: set[bytes] = set()  # keys a promotion holds: pinned, hidden from lookup
        # Moving keys the device cached meanwhile: dropped below when their promotion ends.
        self.superseded: set[bytes] = set()
        self.num_discarded_blocks = 0  # copies below dropped because the device cached the key

    def start(self, keys: list[bytes], keep_unloaded: bool) -> Promotion:
        """Pin, read and hide the leading run of ``keys`` held below and not moving already."""
        host, disk = self._placement.host, self._placement.disk
        with self._lock:
            sources: list[PromotionSource] = []
            for key in keys:
                if key in self.moving:
                    break
                slot = host.slot_of(key)
                if slot is not None:
                    host.pin(key)
                    sources.append(PromotionSource(key, slot, None, host.owner_of(key)))
                elif disk is not None and disk.contains(key):
                    sources.append(PromotionSource(key, None, disk.fetch(key), disk.owner_of(key)))
                else:
                    break
                self.moving.add(key)
            return Promotion(self, sources, len(keys), keep_unloaded)

    def copy_host_sources(self, promotion: Promotion) -> None:
        """Issue the host -> device copies of an assigned promotion (they overlap planning on CUDA).

        ``Promotion.assign`` calls it (``PromotionMover``); nothing else should."""
        assert promotion.block_ids is not None
        with self._lock:
            pairs = [
                (source, block_id)
                for source, block_id in zip(promotion.sources, promotion.block_ids, strict=False)
                if source.host_slot is not None
            ]
            if not pairs:
                return
            host = self._placement.host
            views = [host.get(source.key) for source, _ in pairs]  # counted, marked recently used
            self._placement.device.write_blocks([b for _, b in pairs], [v for v in views if v is not None])

    def complete_promotion(
        self, promotion: Promotion, timeout_s: float | None, cancel: bool
    ) -> PromotionResult:
        """End ``promotion``: loaded blocks leave host/disk, the rest stay (a swap-in's are freed).

        ``Promotion.wait`` / ``cancel`` call it (``PromotionMover``); nothing else should."""
        sources = promotion.sources
        block_ids = [] if cancel or promotion.block_ids is None else promotion.block_ids
        assigned = sources[: len(block_ids)]
        reads = [s.read for s in assigned if s.read is not None]
        _, not_done = wait_futures(reads, timeout=timeout_s)
        if not_done:
            raise TimeoutError(
                f"{len(not_done)} of {len(reads)} disk reads still running after {timeout_s} s"
            )
        num_loaded = 0
        from_disk: list[tuple[int, torch.Tensor]] = []
        for source, block_id in zip(assigned, block_ids, strict=True):
            if source.read is not None:
                data = read_result(source.read)
                if data is None:
                    break  # a failed disk read: the chain stops here
                from_disk.append((block_id, data))
            num_loaded += 1
        device = self._placement.device
        try:
            if from_disk:
                device.write_blocks([b for b, _ in from_disk], [d for _, d in from_disk])
            # Host slots stay pinned until the device is done copying from them.
            device.synchronize()
        except BaseException:
            # The device blocks may hold anything: nothing counts as loaded, every key stays
            # where it was (findable again), and the caller releases its device blocks.
            self._release_sources(promotion, 0)
            raise
        self._release_sources(promotion, num_loaded)
        return PromotionResult(
            num_loaded=num_loaded,
            num_requested=promotion.num_requested,
            keys=[s.key for s in sources[:num_loaded]],
            block_ids=block_ids[:num_loaded],
        )

    def _release_sources(self, promotion: Promotion, num_loaded: int) -> None:
        """Unhide and unpin a finished promotion's keys; the loaded ones leave host/disk."""
        host, disk = self._placement.host, self._placement.disk
        with self._lock:
            for position, source in enumerate(promotion.sources):
                self.moving.discard(source.key)
                loaded = position < num_loaded
                superseded = source.key in self.superseded
                self.superseded.discard(source.key)
                # Not loaded but superseded: the device cached the key meanwhile, so the
                # copy below would be a second location.
                drop = loaded or not promotion.keep_unloaded or superseded
                removed = False
                if source.host_slot is not None:
                    host.unpin(source.key)
                    if drop:
                        removed = host.remove(source.key, promoted=loaded)
                elif disk is not None and drop:
                    removed = disk.remove(source.key, promoted=loaded)
                if removed and superseded and not loaded:
                    self.num_discarded_blocks += 1

    def discard(self, keys: Collection[bytes]) -> int:
        """Drop the host/disk copies of ``keys``, which the device holds now; how many went now.

        A key a promotion is moving is marked superseded instead and goes when the
        promotion ends (module docstring).
        """
        with self._lock:
            dropped = 0
            for key in keys:
                if key in self.moving:
                    self.superseded.add(key)
                elif self._placement.forget(key):
                    dropped += 1
            self.num_discarded_blocks += dropped
            return dropped

    def keep_below(self, key: bytes) -> None:
        """The device lets go of ``key`` (its copy there is evicted): a superseded copy below is
        the block's only location again and must stay."""
        with self._lock:
            self.superseded.discard(key)
