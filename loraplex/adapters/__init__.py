"""PEFT LoRA adapters: parse and validate uploads, identify them, serve them from three tiers.

- ``spec``: the base model's LoRA-able layers and the stacking groups (qkv, o, gate_up, down);
- ``peft_config`` / ``peft_weights`` / ``loader``: read ``adapter_config.json`` and
  ``adapter_model.safetensors``, reject what cannot be served, fold PEFT's scaling into B;
- ``patterns``: PEFT's rank/alpha pattern keys matched in linear time (no backtracking);
- ``archive``: safe extraction of archives; ``store``: the content-addressed store (the disk tier,
  shared with the gateway's uploads); ``uploads``: checking an upload before it is stored;
- ``host_cache``: the host LRU; ``slot_table`` / ``slot_buffers``: the device slots;
- ``manager``: ``AdapterManager``, what the engine talks to.

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
from loraplex.adapters.manager import AdapterManager, AdapterStats
from loraplex.adapters.peft_weights import AdapterWeights, LoRAModuleWeights
from loraplex.adapters.registry import AdapterInfo
from loraplex.adapters.request import LoRARequest
from loraplex.adapters.slot_buffers import SlotBuffers
from loraplex.adapters.spec import GROUPS, MODULE_NAMES, BaseModelSpec, GroupName, ModuleName
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
    "SlotBuffers",
    "StagedAdapter",
    "ValidationReason",
    "content_version",
    "read_adapter",
]
