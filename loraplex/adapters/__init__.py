"""PEFT LoRA adapters: parse and validate uploads, identify them, serve them from three tiers.

| module | owns |
|---|---|
| ``manager`` | ``AdapterManager``: what the engine talks to; the lock over the tiers; acquire, release |
| ``registration`` | ``Registration``: staging, registering, removing (draining); ``AdapterInfo``; checks |
| ``prefetch`` | ``Prefetcher``: background store reads ahead of requests (``prefetch``, read-ahead) |
| ``stats`` | ``AdapterStats``: the tiers at one moment (counts, moves, resident adapters, load times) |
| ``residency`` | ``DeviceResidency``: the device tier: slots, page tables, loads, LRU eviction |
| ``page_pool`` | ``LoRAPagePool``: adapter weights in rank-granular pages, per projection group |
| ``page_table`` | ``PageTable``, ``Remaps``, ``pages_needed``: an adapter's pages per group; their moves |
| ``group_pool`` | ``GroupPool``: one group's page tensors per layer, scales, free list; writing pages |
| ``page_placement`` | ``Placement``: where the group tensors lie in the arena; packing, views, check |
| ``page_arena`` | ``PageArena``: the memory the pages are laid out in (KV blocks, or ``OwnedArena``) |
| ``slot_table`` / ``slot_buffers`` | slot states, pins and LRU; what one projection hands the kernels |
| ``load_times`` / ``resident`` | device load durations (a histogram); which adapters are resident where |
| ``host_cache`` | ``HostAdapterCache``: the host LRU (``max_cpu_loras``, ``cpu_lora_memory``) |
| ``store_reads`` | ``StoreReads``: background reads from the store into host memory, their errors |
| ``store`` / ``archive`` | the content-addressed store (the disk tier, shared with uploads); archives |
| ``uploads`` / ``layout`` | checking an upload before it is stored; which files of a folder are read |
| ``loader`` / ``peft_config`` / ``peft_weights`` | read PEFT files, refuse the unservable, fold in scaling |
| ``patterns`` | PEFT's rank/alpha pattern keys, matched in linear time (no backtracking) |
| ``spec`` | the base model's LoRA-able layers and the stacking groups (qkv, o, gate_up, down) |
| ``registry`` / ``identity`` | adapters by id and draining slots; owner, name, content version |
| ``request`` / ``config`` / ``errors`` | ``LoRARequest``; ``AdapterManagerConfig``; the subsystem's errors |

See docs/adapters.md.
"""

from loraplex.adapters.archive import ArchiveLimits
from loraplex.adapters.config import AdapterManagerConfig
from loraplex.adapters.errors import (
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    AdapterRemovedError,
    AdapterValidationError,
    NoFreeSlotError,
    ValidationReason,
)
from loraplex.adapters.identity import AdapterIdentity, content_version
from loraplex.adapters.loader import ParsedAdapter, read_adapter
from loraplex.adapters.manager import AdapterManager
from loraplex.adapters.peft_weights import AdapterWeights, LoRAModuleWeights
from loraplex.adapters.registry import AdapterInfo
from loraplex.adapters.request import LoRARequest
from loraplex.adapters.resident import ResidentAdapter
from loraplex.adapters.slot_buffers import SlotBuffers
from loraplex.adapters.spec import GROUPS, MODULE_NAMES, BaseModelSpec, GroupName, ModuleName
from loraplex.adapters.stats import AdapterStats
from loraplex.adapters.store import StagedAdapter

__all__ = [
    "GROUPS",
    "MODULE_NAMES",
    "AdapterError",
    "AdapterExistsError",
    "AdapterIdentity",
    "AdapterInfo",
    "AdapterManager",
    "AdapterManagerConfig",
    "AdapterNotFoundError",
    "AdapterRemovedError",
    "AdapterStats",
    "AdapterValidationError",
    "AdapterWeights",
    "ArchiveLimits",
    "BaseModelSpec",
    "GroupName",
    "LoRAModuleWeights",
    "LoRARequest",
    "ModuleName",
    "NoFreeSlotError",
    "ParsedAdapter",
    "ResidentAdapter",
    "SlotBuffers",
    "StagedAdapter",
    "ValidationReason",
    "content_version",
    "read_adapter",
]
