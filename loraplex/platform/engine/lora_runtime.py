"""The engine's adapters: the ``AdapterManager`` on the engine's device, its registry, and the
parts that serve a step, composed behind one facade.

Per step:
- admission (``lora_admission``): the scheduler's adapter hooks: a waiting sequence runs once
  it holds a pin on its adapter (paged in if need be), the drain rule, read-ahead, release;
- execution (``step_slots``, then ``lora_passes``): each scheduled sequence's adapter slot (from
  its pin) goes into the step's ``ForwardBatch``; the runtime is the batch's ``LoRAApplier``,
  whose page passes add every adapter's delta per projection group;
- refusals (``lora_refusals``): what a request refused for its adapter is told.

The registry (``add_lora`` ... ``resolve``) is here: a request's adapter is resolved to the exact
version served (its content identity) before it is queued.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from loraplex.adapters import (
    AdapterError,
    AdapterIdentity,
    AdapterManager,
    AdapterManagerConfig,
    BaseModelSpec,
    LoRARequest,
    StagedAdapter,
)
from loraplex.adapters.page_arena import PageArena
from loraplex.kernels.metadata import LoRAMetadata
from loraplex.kernels.registry import select_lora_backend
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.errors import AdapterUnavailableError
from loraplex.platform.engine.lora_admission import LoRAAdmission
from loraplex.platform.engine.lora_passes import LoRAPasses
from loraplex.platform.engine.scheduler import AdmitDecision
from loraplex.platform.engine.scheduler_output import SchedulerOutput
from loraplex.platform.engine.sequence import Sequence
from loraplex.platform.model.forward_batch import LoRASites

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class LoRARuntime:
    """Owns the ``AdapterManager`` on the engine's device; the scheduler's adapter hooks
    (``admission``) and the LoRA hook (``passes``) are its parts."""

    idle_wait_s = 0.05
    """How long an idle step waits for an adapter read before returning (empty) to its caller."""

    def __init__(
        self,
        config: EngineConfig,
        hf_config: PretrainedConfig,
        device: torch.device,
        dtype: torch.dtype,
        arena: PageArena | None = None,
    ) -> None:
        """``arena``: where adapter pages live (the engine's KV pool); None: memory of their own."""
        self.block_size = config.block_size
        self.backend = select_lora_backend(config.lora_backend, device)
        self.adapter_manager = AdapterManager(
            BaseModelSpec.from_hf_config(hf_config),
            AdapterManagerConfig(
                max_loras=config.max_loras,
                max_lora_rank=config.max_lora_rank,
                max_cpu_loras=config.cpu_lora_capacity,
                cpu_lora_memory=config.cpu_lora_memory_bytes,
                lora_page_rank=config.lora_page_rank,
                lora_memory=config.lora_memory_bytes,
            ),
            device=device,
            dtype=dtype,
            weight_layout=self.backend.weight_layout(dtype, device),
            arena=arena,
        )
        self.admission = LoRAAdmission(self.adapter_manager, self.block_size)
        self.passes = LoRAPasses(self.adapter_manager, self.backend)
        # (int_id, path) of a request naming a registered id from another path -> that path's version.
        self._same_content: dict[tuple[int, str], str] = {}

    # -- registry -------------------------------------------------------------------
    def add_lora(self, lora: LoRARequest, owner: str | None = None, served_name: str | None = None) -> None:
        """Validate and register ``lora`` (no-op if this exact adapter is registered)."""
        self.register_lora(lora, self.stage_lora(lora), owner, served_name)

    def stage_lora(self, lora: LoRARequest) -> StagedAdapter:
        """Validate ``lora``'s files into the adapter store: slow, safe on any thread, changes
        nothing the engine serves; ``register_lora`` (on the engine thread) follows."""
        return self.adapter_manager.stage_lora(lora)

    def register_lora(
        self,
        lora: LoRARequest,
        staged: StagedAdapter,
        owner: str | None = None,
        served_name: str | None = None,
    ) -> None:
        """Register a staged adapter (fast; the engine thread, between steps)."""
        self.adapter_manager.register_lora(lora, staged, owner=owner, served_name=served_name)
        self.admission.on_registered(lora.int_id)

    def discard_staged_lora(self, staged: StagedAdapter) -> None:
        """Release a staged adapter that will not be registered."""
        self.adapter_manager.discard_staged_lora(staged)

    def remove_lora(self, int_id: int) -> None:
        """Refuse new requests for the adapter; running ones finish on its old weights."""
        self.adapter_manager.remove_lora(int_id)
        self.admission.on_removed(int_id)
        self._same_content = {k: v for k, v in self._same_content.items() if k[0] != int_id}

    def list_loras(self) -> list[int]:
        return [info.adapter_id for info in self.adapter_manager.list_adapters()]

    def lora_tiers(self) -> dict[int, str]:
        """Each registered adapter's fastest tier now: ``device`` (a slot), ``host`` or ``disk``."""
        return {info.adapter_id: info.tier for info in self.adapter_manager.list_adapters()}

    def resolve(self, lora: LoRARequest, owner: str | None = None) -> AdapterIdentity:
        """Make sure ``lora`` is registered (first use loads it, as in vLLM); its identity.

        Raises ``AdapterUnavailableError`` when its files cannot be served, or when its id and
        name are registered from another path with other content (serving the registered
        weights for it would silently answer with the wrong adapter).
        """
        if not isinstance(lora, LoRARequest):
            raise AdapterUnavailableError(
                f"lora_request must be a LoRARequest, got {type(lora).__name__}", param="lora_request"
            )
        known = {info.adapter_id: info for info in self.adapter_manager.list_adapters()}
        info = known.get(lora.int_id)
        if info is None:
            try:
                info = self.adapter_manager.add_lora(lora, owner=owner)
            except AdapterError as exc:
                raise AdapterUnavailableError(f"adapter {lora.name!r}: {exc}", param="model") from exc
            self.admission.on_registered(lora.int_id)
        elif info.name != lora.name:
            raise AdapterUnavailableError(
                f"lora_request int_id {lora.int_id} is registered as {info.name!r}, not {lora.name!r}",
                param="lora_request",
            )
        elif info.source != lora.path:
            self._check_same_content(lora, info.source, info.version)
        return info.identity

    def _check_same_content(self, lora: LoRARequest, registered_path: str, version: str) -> None:
        """Refuse ``lora`` if its path holds other weights than the ones registered under its id."""
        key = (lora.int_id, lora.path)
        found = self._same_content.get(key)
        if found is None:
            try:
                staged = self.adapter_manager.stage_lora(lora)
            except AdapterError as exc:
                raise AdapterUnavailableError(f"adapter {lora.name!r}: {exc}", param="model") from exc
            found = staged.parsed.version
            self.adapter_manager.discard_staged_lora(staged)
            self._same_content[key] = found
        if found != version:
            raise AdapterUnavailableError(
                f"lora_request {lora.name!r} (int_id {lora.int_id}) names {lora.path}, but that id is "
                f"registered from {registered_path} with other weights (version {version[:12]}, the new "
                f"path holds {found[:12]}); remove_lora({lora.int_id}) first to serve the new files, or "
                "give them another int_id",
                param="lora_request",
            )

    # -- the scheduler's hooks (``LoRAAdmission``) -------------------------------------
    def admit(self, seq: Sequence) -> AdmitDecision:
        return self.admission.admit(seq)

    def load(self, seq: Sequence, keep_free_blocks: int) -> AdmitDecision:
        return self.admission.load(seq, keep_free_blocks)

    def give_back_memory(self, num_blocks: int) -> int:
        return self.admission.give_back_memory(num_blocks)

    def lookahead(self, waiting: list[Sequence]) -> None:
        self.admission.lookahead(waiting)

    def release(self, seq: Sequence) -> None:
        self.admission.release(seq)

    def on_fork(self, parent: Sequence, child: Sequence) -> None:
        self.admission.on_fork(parent, child)

    def wait_for_a_read(self) -> bool:
        """The step would be empty: block (up to ``idle_wait_s``) until a background adapter
        read finishes; True if one did."""
        return self.adapter_manager.wait_for_a_read(self.idle_wait_s)

    @property
    def num_pins(self) -> int:
        """Slot pins held by running sequences (0 when nothing runs on an adapter)."""
        return self.admission.num_pins

    # -- execution (``LoRAPasses``) ----------------------------------------------------
    def step_slots(self, out: SchedulerOutput) -> list[int] | None:
        """Each scheduled sequence's adapter slot (-1 = base model); None if no adapter runs."""
        self.admission.next_step()
        slots = [
            -1 if item.seq.request.lora is None else self.admission.pinned_slot(item.seq)
            for item in out.scheduled
        ]
        if all(s < 0 for s in slots):
            return None
        self.passes.start_step()
        return slots

    def apply(self, layer_idx: int, group: str, x: torch.Tensor, y: torch.Tensor, meta: LoRAMetadata) -> None:
        """``LoRAApplier``: add the LoRA deltas of ``group`` in layer ``layer_idx`` to ``y``."""
        self.passes.apply(layer_idx, group, x, y, meta)

    def c_sites(self, meta: LoRAMetadata, num_layers: int) -> LoRASites | None:
        """The step's LoRA as prebound C kernel calls, per layer and group (``LoRABatch.c_sites``)."""
        return self.passes.c_sites(meta, num_layers)

    def check_integrity(self, running: Iterable[Sequence] | None = None) -> None:
        """Adapter slots and pages consistent (``AdapterManager.check_integrity``); with
        ``running``: pins match the running sequences (each running sequence on an adapter
        holds one pin on that adapter's slot, nothing else holds a pin)."""
        self.adapter_manager.check_integrity()
        if running is not None:
            self.admission.check_pins(running)
