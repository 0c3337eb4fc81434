"""Which adapters are resident, and where: what routers read to send an adapter's requests to a
replica that holds it (``vllm:lora_adapter_loaded``).

``resident_adapters`` lists the adapters in device pages (``gpu``), then those only in the host
LRU (``cpu``), most recently used first within each level; ``tier_stats`` (``stats.py``) calls it
under the manager's lock once per snapshot (one pass over the registered adapters, as the counts beside it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from loraplex.adapters.host_cache import HostAdapterCache
from loraplex.adapters.registry import AdapterEntry
from loraplex.adapters.slot_table import SlotTable

Level = Literal["gpu", "cpu"]
"""Where a resident adapter is, in vLLM's words: ``gpu`` = the device page pool (on a CPU-only
engine too), ``cpu`` = only the host LRU."""


@dataclass(frozen=True)
class ResidentAdapter:
    """One adapter a router could send its requests to without a store read."""

    adapter_id: int
    name: str
    """``AdapterIdentity.display_name``: what clients put in ``model``."""
    level: Level
    pinned: bool
    """A running request uses it (it cannot be evicted now)."""
    rank: int


def resident_adapters(
    entries: list[AdapterEntry], slots: SlotTable, host: HostAdapterCache
) -> tuple[ResidentAdapter, ...]:
    """The live ``entries`` that are resident: device first, then host-only, most recent first."""
    by_slot = {slot: e for e in entries if (slot := slots.slot_of(e.identity.adapter_id)) is not None}
    device = [
        ResidentAdapter(
            e.identity.adapter_id, e.identity.display_name, "gpu", slots.pin_count(slot) > 0, e.rank
        )
        for slot in reversed(slots.lru_order())
        if (e := by_slot.get(slot)) is not None
    ]
    on_device = {r.adapter_id for r in device}
    recent = {version: i for i, version in enumerate(reversed(host.versions()))}
    host_only = sorted(
        (e for e in entries if e.identity.adapter_id not in on_device and e.identity.version in recent),
        key=lambda e: recent[e.identity.version],
    )
    return (
        *device,
        *(
            ResidentAdapter(e.identity.adapter_id, e.identity.display_name, "cpu", False, e.rank)
            for e in host_only
        ),
    )
