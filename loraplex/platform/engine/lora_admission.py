"""Which waiting sequence may run on its adapter now: pins, the drain rule and read-ahead.

The scheduler's adapter hooks (``LoRARuntime`` hands them over):
- admission (``admit``, then ``load``): a waiting sequence with an adapter is admitted only
  once it holds a pin on the adapter (resident: its pages in the device page pool);
  otherwise its weights are prefetched from disk in the background and the sequence waits
  without blocking others. An adapter in host memory is paged in (``load``) after the
  sequence's KV is allocated, into blocks still free (evicting unpinned adapters, least
  recently used first), at most ``lora_memory`` of the pool;
- read-ahead (``lookahead``): the adapters of the next waiting sequences are read from the
  store while the step runs;
- release: finishing, aborting or preempting a sequence unpins its slot; a forked sibling
  pins its parent's.

Who holds which slot is recorded once, in the adapter manager's slot table (a pin per
sequence, keyed ``seq-<seq_id>``); admission asks it rather than keeping a copy.

No starvation: once an adapter has been blocked (no room: the pages or slots it needs
are all pinned) for ``drain_after_steps`` steps, one *draining* adapter is chosen (fewest
pins) and no new sequence is admitted onto it. Its running sequences finish in bounded
time (``max_tokens``), it unpins and becomes evictable; if that is not room enough (pages
are memory: a rank-64 adapter may need several small ones' pages), the next one drains,
and so on, until the blocked adapter fits: LoRAX's adapter cycling, driven by demand
rather than a timer.

Memory policy between adapters and the KV cache: one pool (``storage/kv/kv_arena.py``),
KV first. Adapter pages borrow free blocks from the pool's top; an adapter never preempts
a running sequence or takes a block a sequence holds, and before a sequence is preempted
or refused for KV, the adapters no running sequence uses give their blocks back
(``give_back_memory``). KV pressure never evicts an adapter a running sequence uses.
"""

from __future__ import annotations

from collections.abc import Iterable

from loraplex.adapters import AdapterError, AdapterManager, NoFreeSlotError
from loraplex.platform.engine.errors import ErrorKind, RequestError
from loraplex.platform.engine.lora_refusals import public_name, refuse
from loraplex.platform.engine.scheduler import AdmitDecision
from loraplex.platform.engine.sequence import SeqStatus, Sequence


class LoRAAdmission:
    """Admits sequences onto their adapters' slots, drains adapters for blocked ones, reads ahead."""

    blocked_expiry_steps = 64
    """A blocked adapter not refused for this many steps is forgotten (its requests were
    aborted or finished another way), so its draining adapters admit again."""

    lookahead_adapters = 32
    """Distinct adapters of the next waiting requests read ahead from the store each step
    (within half the host cache), so a request rarely waits for its adapter's read."""

    drain_after_steps = 8
    """Grace before draining a slot for a blocked adapter: short waits cost nothing,
    while draining at once would stall requests for resident adapters."""

    def __init__(self, adapter_manager: AdapterManager, block_size: int) -> None:
        self.adapter_manager = adapter_manager
        self.block_size = block_size
        # Blocked adapter id -> (step first blocked, step last refused): an entry not refused
        # for blocked_expiry_steps (its requests ended another way) is dropped in next_step.
        self._blocked: dict[int, tuple[int, int]] = {}
        self._draining: set[int] = set()  # adapter ids no new sequence is admitted onto
        self._removed: set[int] = set()  # ids removed at run time, for clear errors
        self._step = 0

    # -- the registry's changes -------------------------------------------------------
    def on_registered(self, int_id: int) -> None:
        """``int_id`` is registered (again): its requests are no longer told it was removed."""
        self._removed.discard(int_id)

    def on_removed(self, int_id: int) -> None:
        """``int_id`` was removed: it no longer waits for room, and its waiting requests are told why."""
        self._blocked.pop(int_id, None)
        self._removed.add(int_id)

    # -- the scheduler's hooks --------------------------------------------------------
    @staticmethod
    def _key(seq: Sequence) -> str:
        return f"seq-{seq.seq_id}"

    def admit(self, seq: Sequence) -> AdmitDecision:
        lora = seq.request.lora
        if lora is None:
            return AdmitDecision.OK
        aid = lora.int_id
        try:
            if aid in self._draining and self._blocked and aid not in self._blocked:
                return AdmitDecision.WAIT  # let the draining adapter empty for a blocked one
            if self.adapter_manager.is_resident(aid):
                return self._pin(seq)
            if self.adapter_manager.can_acquire(aid):
                return AdmitDecision.LOAD  # paged in once the sequence's KV is allocated
            # Not read here: the scheduler's lookahead starts the reads for the waiting
            # sequences in admission order, bounded by the host cache (reading for every
            # sequence admission reaches would push earlier reads out before they are used).
            self.adapter_manager.prefetch(aid, start=False)
        except AdapterError as exc:
            refuse(seq, exc, removed=aid in self._removed)
            return AdmitDecision.REJECT
        return self._blocked_wait(aid)

    def _pin(self, seq: Sequence, keep_free_blocks: int = 0) -> AdmitDecision:
        assert seq.request.lora is not None
        aid = seq.request.lora.int_id
        self.adapter_manager.acquire(aid, self._key(seq), keep_free_blocks=keep_free_blocks)
        if self._blocked.pop(aid, None) is not None:
            # The blocked adapter got its room; drain again only for another one.
            self._draining.clear()
        return AdmitDecision.OK

    def load(self, seq: Sequence, keep_free_blocks: int) -> AdmitDecision:
        """After ``admit`` said LOAD: page the sequence's adapter in and pin it, leaving
        ``keep_free_blocks`` of the pool free for the sequence's KV (OK); or WAIT (no room
        now); or REJECT (the adapter and that KV never fit the pool together)."""
        lora = seq.request.lora
        assert lora is not None
        try:
            return self._pin(seq, keep_free_blocks)
        except NoFreeSlotError:
            pass
        except AdapterError as exc:
            refuse(seq, exc)
            return AdmitDecision.REJECT
        kv_blocks = -(-seq.num_tokens // self.block_size)
        if not self.adapter_manager.could_ever_fit_beside(lora.int_id, kv_blocks):
            seq.request.error = RequestError(
                ErrorKind.INVALID,
                f"adapter {public_name(lora)!r} and this request's KV do not fit the "
                "device pool together; shorten the prompt or raise kv_cache_memory",
            )
            return AdmitDecision.REJECT
        return self._blocked_wait(lora.int_id)

    def give_back_memory(self, num_blocks: int) -> int:
        """The scheduler's memory hook: ``num_blocks`` pool blocks back to the KV cache (see
        ``AdapterManager.give_back_memory``); how many came back."""
        return self.adapter_manager.give_back_memory(num_blocks)

    def _blocked_wait(self, aid: int) -> AdmitDecision:
        """``aid`` has no room now: remember it, and drain an adapter if it waited long enough."""
        since, _ = self._blocked.get(aid, (self._step, self._step))
        self._blocked[aid] = (since, self._step)
        if self._step - since >= self.drain_after_steps:
            pins: dict[int, int] = {}
            for adapter_id in self.adapter_manager.pins().values():
                pins[adapter_id] = pins.get(adapter_id, 0) + 1
            if not any(pins.get(a, 0) for a in self._draining):
                # Nothing is draining, or what drained has emptied (it is evictable now) and
                # there is still no room: drain one more, the one with the fewest running
                # users (it empties soonest). Memory may need several adapters' pages.
                candidates = {a: n for a, n in pins.items() if a != aid and a not in self._draining}
                if candidates:
                    self._draining.add(min(candidates, key=lambda a: (candidates[a], a)))
        return AdmitDecision.WAIT

    def lookahead(self, waiting: list[Sequence]) -> None:
        """After admission: read ahead the adapters of the next waiting sequences (in the order
        admission will try them) while this step runs; queued reads nobody needs are dropped."""
        ids: list[int] = []
        seen: set[int] = set()
        for seq in waiting:
            lora = seq.request.lora
            if lora is None or lora.int_id in seen or seq.status is not SeqStatus.WAITING:
                continue
            seen.add(lora.int_id)
            ids.append(lora.int_id)
            if len(ids) >= self.lookahead_adapters:
                break
        self.adapter_manager.prefetch_ahead(ids, self.lookahead_adapters)

    def release(self, seq: Sequence) -> None:
        self.adapter_manager.release(self._key(seq))

    def on_fork(self, parent: Sequence, child: Sequence) -> None:
        """A forked sibling uses its parent's (resident, pinned) adapter slot too."""
        lora = parent.request.lora
        if lora is not None and self.adapter_manager.pinned_slot(self._key(parent)) is not None:
            self.adapter_manager.acquire(lora.int_id, self._key(child))

    # -- per step ---------------------------------------------------------------------
    def next_step(self) -> None:
        """A step begins: blocked adapters no longer refused are forgotten (their draining with them)."""
        self._step += 1
        # A blocked adapter is refused only when admission reaches its request (not while the
        # step's seats are full), so allow long gaps; past this one its requests ended otherwise.
        stale = [a for a, (_, last) in self._blocked.items() if self._step - last > self.blocked_expiry_steps]
        for adapter_id in stale:
            del self._blocked[adapter_id]
        if not self._blocked:
            self._draining.clear()

    def pinned_slot(self, seq: Sequence) -> int:
        """The slot ``seq`` (scheduled on an adapter) holds its pin on."""
        slot = self.adapter_manager.pinned_slot(self._key(seq))
        if slot is None:
            raise AssertionError(f"seq {seq.seq_id} is scheduled on an adapter but holds no slot pin")
        return slot

    @property
    def num_pins(self) -> int:
        """Slot pins held by running sequences (0 when nothing runs on an adapter)."""
        return sum(self.adapter_manager.pins_by_slot().values())

    def check_pins(self, running: Iterable[Sequence]) -> None:
        """Pins match the running sequences: each running sequence on an adapter holds one pin
        on that adapter's slot, nothing else holds a pin."""
        want = {self._key(seq): seq.request.lora.int_id for seq in running if seq.request.lora is not None}
        held = self.adapter_manager.pins()
        if set(held) != set(want):
            raise AssertionError(f"adapter pins {sorted(held)} != running sequences {sorted(want)}")
        for key, adapter_id in want.items():
            if held[key] != adapter_id:
                raise AssertionError(f"{key} pins adapter {held[key]}, runs on adapter {adapter_id}")
