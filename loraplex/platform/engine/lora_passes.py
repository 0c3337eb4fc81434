"""The step's LoRA in the forward: per projection group, page passes over the step's tokens.

Each scheduled sequence contributes its adapter's slot (resident handle) to the per-token
slot list that goes into the step's ``ForwardBatch``; per projection group, ``LoRAPasses``
turns the slots into page passes (``_StepPages``: pass i maps each token to page i of its
adapter's pages there) and the backend adds every adapter's delta, whatever its rank, in one
``apply_paged`` call: from the model's LoRA hook (``apply``), or planned once per step as
prebound C kernel calls (``c_sites``).
"""

from __future__ import annotations

import torch

from loraplex.adapters import AdapterManager
from loraplex.adapters.page_table import PageTable
from loraplex.kernels.contracts import LoRABackend
from loraplex.kernels.cpu.lora import BoundSite, PackedWeights
from loraplex.kernels.metadata import LoRAMetadata
from loraplex.kernels.step_cache import IdentityCache
from loraplex.platform.model.forward_batch import LoRASites
from loraplex.platform.model.llama import LORA_GROUPS


class LoRAPasses:
    """The step's page passes per group, and the adapter pool's weights read through them."""

    def __init__(self, adapter_manager: AdapterManager, backend: LoRABackend) -> None:
        self.adapter_manager = adapter_manager
        self.backend = backend
        self._step_pages: IdentityCache[LoRAMetadata, _StepPages] = IdentityCache(max_entries=4)
        self._page_tables: dict[int, PageTable] = {}
        self._pool_generation = adapter_manager.pool_generation
        # (layer, group) -> the checked pool weights there (c_sites): the pool tensors stay
        # the same until it reallocates (a new generation clears this).
        self._site_weights: dict[tuple[int, str], PackedWeights] = {}

    def start_step(self) -> None:
        """A step that runs adapters begins: read the pages of every adapter it uses once (the
        kernels read them per layer); a reallocated pool drops what was cached of the old one."""
        self._page_tables = self.adapter_manager.page_tables()
        generation = self.adapter_manager.pool_generation
        if generation != self._pool_generation:
            self._pool_generation = generation
            self._site_weights.clear()
            forget = getattr(self.backend, "forget_weights", None)
            if forget is not None:
                forget()  # cached views of the old pool tensors would keep them alive

    def apply(self, layer_idx: int, group: str, x: torch.Tensor, y: torch.Tensor, meta: LoRAMetadata) -> None:
        """``LoRAApplier``: add the LoRA deltas of ``group`` in layer ``layer_idx`` to ``y``."""
        passes = self._step_pages.get(meta, self._plan_pages).passes(group)
        if not passes:
            return
        a, b, scales, sizes = self.adapter_manager.get_buffers(layer_idx, group)  # type: ignore[arg-type]
        self.backend.apply_paged(y, x, a, b, scales, sizes, passes)

    def c_sites(self, meta: LoRAMetadata, num_layers: int) -> LoRASites | None:
        """The step's LoRA as prebound C kernel calls, per layer and group (``LoRABatch.c_sites``).

        Planned once per step: each group's page passes and token groups (shared by every
        layer), and each site's checked weights (cached until the page pool reallocates).
        None when the backend has no C kernel or cannot read a site's weights (the hook
        serves the step then, with the same result).
        """
        prebind = getattr(self.backend, "prebind_paged", None)
        if prebind is None:
            return None
        pages = self._step_pages.get(meta, self._plan_pages)
        sites: list[tuple[BoundSite | None, ...]] = []
        per_group = [(g, pages.passes(g)) for g in LORA_GROUPS]
        for layer in range(num_layers):
            row: list[BoundSite | None] = []
            for group, passes in per_group:
                if not passes:
                    row.append(None)
                    continue
                weights = self._site_weights.get((layer, group))
                if weights is None:
                    a, b, scales, sizes = self.adapter_manager.get_buffers(layer, group)  # type: ignore[arg-type]
                    weights = self.backend.packed_weights(a, b, scales, sizes)  # type: ignore[attr-defined]
                    if weights is None:
                        return None
                    self._site_weights[(layer, group)] = weights
                row.append(prebind(weights, passes))
            sites.append(tuple(row))
        return sites

    def _plan_pages(self, meta: LoRAMetadata) -> _StepPages:
        return _StepPages(meta, self._page_tables)


class _StepPages:
    """One step's page passes per projection group, derived from its slot metadata.

    ``passes(group)[i]`` maps each token to page ``i`` of its adapter's ``group`` pages
    (-1: the adapter has fewer pages there, does not target the group, or the token runs
    on the base model). Built per group on first use, from the segments (O(sequences)).
    """

    def __init__(self, meta: LoRAMetadata, page_tables: dict[int, PageTable]) -> None:
        self._starts = meta.seg_starts_cpu or tuple(meta.seg_starts.tolist())
        self._slots = meta.seg_slots_cpu or tuple(meta.seg_slots.tolist())
        self._device = meta.token_slots.device
        self._tables = page_tables
        self._passes: dict[str, tuple[LoRAMetadata, ...]] = {}

    def passes(self, group: str) -> tuple[LoRAMetadata, ...]:
        found = self._passes.get(group)
        if found is not None:
            return found
        pages = [self._tables[s].get(group, []) if s >= 0 else [] for s in self._slots]  # type: ignore[call-overload]
        depth = max((len(p) for p in pages), default=0)
        found = tuple(
            LoRAMetadata.from_segments(
                self._starts, [p[i] if len(p) > i else -1 for p in pages], self._device
            )
            for i in range(depth)
        )
        self._passes[group] = found
        return found
