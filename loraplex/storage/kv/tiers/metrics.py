"""Counters of one KV tier (host RAM or disk), and the snapshot handed to ``/metrics``.

A pool owns one ``TierCounters`` and bumps it under its own lock; ``snapshot`` freezes
it with the pool's capacity and occupancy into a ``TierMetrics``. What each counter
means, for both tiers:

    hits / misses        blocks asked for (promotion, swap-in) that were / were not served;
                         a read that fails its checks is a miss, never a hit
    promotions           blocks that left this tier for the accelerator
    demotions            blocks this tier accepted from the tier above
    evictions            blocks pushed out to make room (host: down to disk; disk: gone)
    drops                blocks offered that this tier could not keep (no slot; size 0)
    bytes_in / bytes_out block bytes written into / read out of this tier
    io_errors            OSErrors on read or write (ENOSPC, EIO, a directory in a slot's place)
    checksum_failures    records whose payload checksum did not match
    invalid_records      records with a bad header: truncated, zeroed, another model or layout
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierMetrics:
    """One tier's state and counters at one moment."""

    tier: str  # "host" or "disk"
    capacity_blocks: int
    capacity_bytes: int
    used_blocks: int
    used_bytes: int
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    drops: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    io_errors: int = 0
    checksum_failures: int = 0
    invalid_records: int = 0

    @classmethod
    def disabled(cls, tier: str) -> TierMetrics:
        """A tier that is not configured: zero everywhere, so dashboards keep their series."""
        return cls(tier=tier, capacity_blocks=0, capacity_bytes=0, used_blocks=0, used_bytes=0)


@dataclass
class TierCounters:
    """The mutable counters behind ``TierMetrics`` (the owning pool serialises updates)."""

    hits: int = 0
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    drops: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    io_errors: int = 0
    checksum_failures: int = 0
    invalid_records: int = 0

    def snapshot(self, tier: str, capacity_blocks: int, used_blocks: int, block_bytes: int) -> TierMetrics:
        """Freeze the counters with the tier's occupancy; ``block_bytes`` is one slot's size."""
        return TierMetrics(
            tier=tier,
            capacity_blocks=capacity_blocks,
            capacity_bytes=capacity_blocks * block_bytes,
            used_blocks=used_blocks,
            used_bytes=used_blocks * block_bytes,
            hits=self.hits,
            misses=self.misses,
            promotions=self.promotions,
            demotions=self.demotions,
            evictions=self.evictions,
            drops=self.drops,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            io_errors=self.io_errors,
            checksum_failures=self.checksum_failures,
            invalid_records=self.invalid_records,
        )
