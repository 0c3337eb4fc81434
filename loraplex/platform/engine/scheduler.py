"""Continuous batching with a per-step token budget, chunked prefill and preemption.

Each step fills a token budget (``max_num_batched_tokens``): running sequences
first, in admission order (a decode costs one token, an unfinished prefill takes a
chunk of what is left), then waiting sequences are admitted while the budget,
``max_num_seqs`` and free KV blocks allow. Sequences are not split into prefill
and decode phases: each just has ``num_computed_tokens`` out of ``num_tokens``,
which makes chunked prefill, recompute after preemption and decodes one mechanism.

When a running sequence cannot get a block, adapters no running sequence uses give their
blocks of the shared pool back first (``memory_hook``: KV first); if that is not enough,
the lowest-priority running sequence (the most recently admitted under FCFS) is preempted:
its blocks are freed and it goes back to the front of the waiting queue. Its full blocks
stay in the prefix cache (and its tiers); its partial last block is swapped out or
recomputed, as ``PreemptionPolicy`` decides (``preemption_mode``).

Lower tiers never stall a step: when a waiting sequence's cached prefix continues in
host RAM or on disk, the promotion starts (host copies at once, disk reads on the
tier's workers) and the sequence waits, without holding up the sequences behind it,
until its blocks have landed; only when nothing else can run does ``schedule`` block
on the reads.

Order is the ``SchedulingPolicy``'s (``policy``: fcfs, priority): which waiting sequence is
tried first, whom to preempt, and its per-step accounting. Planning one sequence can fail
(its promotion's device copy raises, a bug): that sequence alone ends with an error
(``SchedulerOutput.aborted``, ``request.error`` set) and the step is planned without it.
After the forward, ``update_from_output`` advances what the step computed (and makes the
full blocks findable), and ``fork`` adds a parallel-sampling sibling: the scheduler owns
every sequence's progress.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from loraplex.platform.engine.errors import ErrorKind, RequestError
from loraplex.platform.engine.policy import PolicyName, SchedulingPolicy, make_policy
from loraplex.platform.engine.preemption import PreemptionPolicy
from loraplex.platform.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from loraplex.platform.engine.sequence import SeqStatus, Sequence
from loraplex.platform.engine.speculative import Speculator
from loraplex.platform.engine.tier_admission import TierAdmission, Wait
from loraplex.storage.kv.block_manager import AllocStatus
from loraplex.storage.kv.prefix_cache import NO_HIT, PrefixHit
from loraplex.storage.kv.tiers.tiered_kv import TieredKV

logger = logging.getLogger(__name__)


class AdmitDecision(enum.Enum):
    """What an admission hook (the adapter runtime) says about a waiting sequence."""

    OK = "ok"  # admit (the hook has reserved what it needs, e.g. pinned an adapter slot)
    LOAD = "load"  # admit if, once its KV is allocated, the load hook gets what it needs
    WAIT = "wait"  # not now; later sequences may still be admitted
    REJECT = "reject"  # never (e.g. its adapter was removed): finish it as aborted


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    policy: PolicyName = "fair"
    """The engine's default (``EngineConfig.scheduling_policy``); without tenants it orders like fcfs."""
    # Keep a few blocks free when admitting new work, so the running set does not
    # preempt itself on the very next step (vLLM's watermark).
    watermark_blocks: int = 0


class Scheduler:
    """Owns the waiting and running queues; allocates from the KV cache's block manager."""

    def __init__(
        self,
        limits: SchedulerLimits,
        cache: TieredKV,
        admit_hook: Callable[[Sequence], AdmitDecision] | None = None,
        release_hook: Callable[[Sequence], None] | None = None,
        preemption: PreemptionPolicy | None = None,
        fork_hook: Callable[[Sequence, Sequence], None] | None = None,
        lookahead_hook: Callable[[list[Sequence]], None] | None = None,
        idle_wait_hook: Callable[[], bool] | None = None,
        load_hook: Callable[[Sequence, int], AdmitDecision] | None = None,
        memory_hook: Callable[[int], int] | None = None,
    ) -> None:
        """``lookahead_hook`` sees, after each step's admission, the sequences still waiting in
        the order admission will try them, so the adapter runtime can read the next ones'
        adapters in the background while this step runs. ``idle_wait_hook`` is called when a
        step would be empty while sequences wait: it blocks until something they wait for
        (an adapter read) may have arrived, True then (admission is tried again).

        KV and adapter pages share one pool, KV first: ``load_hook(seq, keep_free)`` runs for a
        sequence the admit hook answered ``LOAD`` (its adapter must be paged in) once its KV
        is known to fit, and pages the adapter in leaving ``keep_free`` blocks free for that
        KV; ``memory_hook(n)`` asks for ``n`` blocks back (adapters no running request uses
        are evicted) before a sequence is preempted or refused for KV."""
        self.limits = limits
        self.policy: SchedulingPolicy = make_policy(limits.policy)
        self.kv = cache.block_manager
        # The host/disk tiers below the pool (if any): prefix hits continue there (promotion),
        # and preempted sequences' partial tails may be swapped there.
        self.tier_io = TierAdmission(cache, preemption, limits.max_num_batched_tokens)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        # Hooks let the adapter manager veto admission (no free slot) and learn
        # when a sequence stops using its adapter; None = no LoRA.
        self._admit_hook = admit_hook
        self._release_hook = release_hook
        self.speculator: Speculator | None = None
        """Proposes speculative drafts for running decodes (``speculative_config``); None: off."""
        self.spec_max_len = 0  # the engine's max_model_len, for the drafts' room
        self._fork_hook = fork_hook
        self._lookahead_hook = lookahead_hook
        self._idle_wait_hook = idle_wait_hook
        self._load_hook = load_hook
        self._memory_hook = memory_hook
        self.num_preemptions = 0
        self.num_planning_failures = 0
        # Sliding window: a sequence may be longer than the pool, but one step's chunk (and the
        # window before it) must fit the pool (``KVBlockManager.max_chunk_tokens``).
        cap = self.kv.max_chunk_tokens()
        self._max_chunk = limits.max_num_batched_tokens if cap is None else max(1, cap)

    # -- queue management --------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.policy.enqueue(self.waiting, seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` as a running sibling of ``parent`` (parallel sampling): it shares
        every block of ``parent`` (copy-on-write) and its adapter slot."""
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent.seq_id, child.seq_id)
        child.status = SeqStatus.RUNNING
        self.running.append(child)
        self.running.sort(key=self.policy.key)
        if self._fork_hook is not None:
            self._fork_hook(parent, child)

    def update_from_output(self, out: SchedulerOutput) -> None:
        """The step ran: each scheduled sequence computed its new tokens. Their newly full
        blocks become findable now, before sampling, finishing or forking, so a sequence's
        blocks are cached when it is freed."""
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if item.num_draft == 0:  # drafts: cached after verification, rejected ones never
                self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
                # Sliding window: blocks no later query reads go back to the pool now (once
                # cached above, so they stay findable until reused), before the next admission.
                # Not under drafts: a rollback may move the window back over them.
                self.kv.free_outside_window(seq.seq_id, seq.num_computed_tokens)

    def rollback(self, seq: Sequence, num_computed: int) -> None:
        """After verification: ``seq`` keeps the KV of its first ``num_computed`` tokens (blocks
        past them go back to the pool), whose full blocks become findable now."""
        seq.num_computed_tokens = num_computed
        self.kv.truncate(seq.seq_id, num_computed)
        self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, num_computed)

    def finish(self, seq: Sequence, status: SeqStatus) -> None:
        """Mark ``seq`` finished and free its blocks; safe to call from any queue."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        # Also for a waiting one: a planning failure may come after its admission pinned an
        # adapter slot (releasing a sequence that holds none is a no-op).
        if self._release_hook is not None:
            self._release_hook(seq)
        seq.status = status
        self.kv.free(seq.seq_id)
        self.tier_io.forget(seq)
        if self.speculator is not None:
            self.speculator.forget(seq)
        self.policy.on_finished(seq)

    def abort(self, seqs: Iterable[Sequence]) -> None:
        for seq in list(seqs):
            if not seq.status.finished:
                self.finish(seq, SeqStatus.FINISHED_ABORTED)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # Counters of the tiers' part in admission and preemption (see ``tier_admission``).
    @property
    def num_promotions_in_flight(self) -> int:
        return self.tier_io.num_promotions_in_flight

    @property
    def num_swapped_out(self) -> int:
        return self.tier_io.num_swapped_out

    @property
    def num_swapped_in(self) -> int:
        return self.tier_io.num_swapped_in

    @property
    def num_swaps_lost(self) -> int:
        return self.tier_io.num_swaps_lost

    def drain(self) -> None:
        """Finish every transfer in flight (waiting for disk reads): before a shutdown."""
        self.tier_io.drain(self.waiting)

    # -- the step ----------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        """Preempt running ``seq`` between steps (a beam search whose beams wait for memory that
        their siblings hold while idle): its KV is freed, it waits at the head of the queue."""
        self._preempt(seq, SchedulerOutput())

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free ``seq``'s KV (its partial tail swapped out, if the policy says so) and put it
        back at the head of the waiting queue."""
        self.running.remove(seq)
        if self._release_hook is not None:
            self._release_hook(seq)
        self.tier_io.swap_out_tail(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.policy.enqueue(self.waiting, seq, front=True)
        out.preempted.append(seq)
        self.num_preemptions += 1
        logger.debug("preempted seq %d (request %s)", seq.seq_id, seq.request.request_id)

    def _victim(self, seq: Sequence, scheduled: dict[int, ScheduledSeq]) -> Sequence:
        """Whom to preempt so ``seq`` can run: the policy's last-ranked running sequence not
        already in this step; ``seq`` itself if it ranks below every one of them."""
        candidates = [s for s in self.running if s.seq_id not in scheduled and s is not seq]
        return self.policy.victim(candidates, seq)

    def _fail(self, seq: Sequence, exc: Exception, out: SchedulerOutput) -> None:
        """Planning ``seq`` raised: end it (and free what it holds) with an error; the step goes on."""
        logger.exception(
            "planning seq %d (request %s) failed; failing it", seq.seq_id, seq.request.request_id
        )
        self.num_planning_failures += 1
        seq.request.error = RequestError(
            ErrorKind.ENGINE_FAILURE, f"internal error while scheduling this request: {exc!r}"
        )
        self.finish(seq, SeqStatus.FINISHED_ABORTED)
        out.aborted.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Blocks on lower-tier reads only when nothing else could run."""
        self.tier_io.finish_orphans()
        out = self._schedule_once()
        while out.is_empty and not out.aborted and self._wait_while_idle():
            out = self._schedule_once()  # everyone left was waiting for blocks or adapters
        self.policy.on_scheduled((item.seq, item.num_new_tokens) for item in out.scheduled)
        return out

    def _wait_while_idle(self) -> bool:
        """Nothing could run: block on what the waiting sequences wait for (blocks coming up
        from host/disk, adapters read from the store) rather than spin. An engine loop that
        spins would also starve the loader thread of the GIL (a read of a few milliseconds
        then takes seconds: each of its GIL hand-backs waits a switch interval)."""
        if self.tier_io.wait_for_a_transfer(self.waiting):
            return True
        return bool(self.waiting) and self._idle_wait_hook is not None and self._idle_wait_hook()

    def _schedule_once(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.limits.max_num_batched_tokens
        scheduled: dict[int, ScheduledSeq] = {}
        if self.speculator is not None:  # every running decode's drafts, proposed together
            self.speculator.plan(self.running, budget, self.spec_max_len)

        # 1. Running sequences, in admission order.
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self.speculator is not None and self._schedule_drafts(seq, budget, out, scheduled):
                budget -= scheduled[seq.seq_id].num_new_tokens
                continue
            num_new = min(seq.num_uncomputed_tokens, budget, self._max_chunk)
            if num_new <= 0:
                continue
            copies = self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            if copies is None and self._reclaim(seq.seq_id, seq.num_computed_tokens, num_new):
                copies = self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            while copies is None:
                victim = self._victim(seq, scheduled)
                self._preempt(victim, out)
                if victim is seq:
                    break
                copies = self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            if copies is None:
                continue
            out.block_copies.extend(copies)
            scheduled[seq.seq_id] = ScheduledSeq(seq, num_new, tuple(self.kv.block_table(seq.seq_id)))
            budget -= num_new

        # 2. Admit waiting sequences (not in a step that had to preempt: memory is tight).
        #    Memory is strictly in the policy's order (a sequence that does not fit stops
        #    admission), but a sequence whose adapter has no slot yet is skipped so it never
        #    blocks requests for resident adapters or the base model.
        order = self.policy.admission_order(self.waiting) if self.waiting else []
        if not out.preempted:
            for seq in order:
                if budget <= 0:
                    break
                width = 1 if seq.request.forked else seq.request.params.n
                if len(self.running) + width > self.limits.max_num_seqs:
                    break
                try:
                    admitted = self._admit(seq, budget, out)
                except Exception as exc:  # this sequence's planning failed, not the step's
                    self._fail(seq, exc, out)
                    continue
                if admitted is _STOP:
                    break
                if isinstance(admitted, ScheduledSeq):
                    scheduled[seq.seq_id] = admitted
                    budget -= admitted.num_new_tokens
        # 3. Read ahead for the sequences still waiting, in the order admission tries them
        #    (before an idle step waits: the reads it waits for must have been started).
        if self._lookahead_hook is not None and order:
            self._lookahead_hook(order)

        # Decodes (one query token) first: backends batch them with one kernel.
        items = list(scheduled.values())
        out.scheduled = [s for s in items if s.num_new_tokens == 1] + [
            s for s in items if s.num_new_tokens > 1
        ]
        return out

    def _schedule_drafts(
        self, seq: Sequence, budget: int, out: SchedulerOutput, scheduled: dict[int, ScheduledSeq]
    ) -> bool:
        """Schedule ``seq``'s decode with speculative drafts appended, if the speculator proposes
        any and their slots are free now (drafts never preempt anyone); True if scheduled."""
        assert self.speculator is not None
        drafts = self.speculator.propose(seq, budget)
        if not drafts:
            return False
        num_new = 1 + len(drafts)
        copies = self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
        if copies is None:
            return False
        seq.token_ids.extend(drafts)  # verification strips them again (output processor)
        out.block_copies.extend(copies)
        table = tuple(self.kv.block_table(seq.seq_id))
        scheduled[seq.seq_id] = ScheduledSeq(seq, num_new, table, num_draft=len(drafts))
        return True

    def _reclaim(
        self, seq_id: int, num_computed: int, num_new: int, hit: PrefixHit = NO_HIT, extra: int = 0
    ) -> bool:
        """Ask the memory hook for the blocks ``seq_id`` lacks (plus ``extra``); True if some came back."""
        if self._memory_hook is None:
            return False
        needed = self.kv.num_new_blocks_needed(seq_id, num_computed, num_new, hit) + extra
        short = needed - self.kv.num_free_blocks
        return short > 0 and self._memory_hook(short) > 0

    def _admit(
        self, seq: Sequence, budget: int, out: SchedulerOutput, loaded: bool = False
    ) -> ScheduledSeq | _Skip:
        """Try to admit one waiting sequence within ``budget`` tokens: its ``ScheduledSeq``,
        ``_SKIP`` (not now; later ones may run) or ``_STOP`` (no memory: admission ends).
        ``loaded``: its adapter was just paged in for it (the second planning)."""
        # Prefix cache: full blocks someone computed before (same tokens, same adapter
        # version, same tenant) are shared instead of recomputed. Nothing may allocate KV
        # between this lookup and allocate_slots below.
        if not self.tier_io.swap_in_ready(seq):
            return _SKIP  # its swapped tail is being read back; later sequences may run
        hit = self.tier_io.prefix_hit(seq) if seq.num_computed_tokens == 0 else NO_HIT
        if hit is None:
            return _SKIP  # its prefix is on its way up from host/disk
        cached = hit.num_cached_tokens
        swapped = self.tier_io.usable_swap(seq, hit)
        if swapped is Wait.PREFIX:
            return _SKIP  # the rest of its prefix is still coming back: the tail stays useful
        resume = swapped.num_computed_tokens if swapped is not None else cached
        num_new = min(seq.num_tokens - resume, budget, self._max_chunk)
        # Blocks for everything from the hit on: the swapped tail lands in the first.
        to_allocate = resume + num_new - cached
        status = self.kv.can_allocate(seq.seq_id, cached + to_allocate, hit)
        if status is AllocStatus.NEVER:
            # Only reachable if the pool shrank after add-time validation.
            seq.request.error = RequestError(ErrorKind.INVALID, "this request can never fit the KV pool")
            self.finish(seq, SeqStatus.FINISHED_ABORTED)
            out.aborted.append(seq)
            logger.error("seq %d can never fit the KV pool; aborted", seq.seq_id)
            return _SKIP
        needed = self.kv.num_new_blocks_needed(seq.seq_id, cached, to_allocate, hit)
        watermark = self.limits.watermark_blocks if self.running else 0
        if (status is AllocStatus.LATER or self.kv.num_free_blocks - needed < watermark) and self._reclaim(
            seq.seq_id, cached, to_allocate, hit, extra=watermark
        ):
            status = self.kv.can_allocate(seq.seq_id, cached + to_allocate, hit)
        if status is AllocStatus.LATER or self.kv.num_free_blocks - needed < watermark:
            return _STOP
        decision = AdmitDecision.OK if self._admit_hook is None else self._admit_hook(seq)
        if decision is AdmitDecision.LOAD and not loaded:
            # Page the adapter in first, into blocks this sequence's KV leaves free. Loading
            # may evict free cached blocks (they go down a tier), so the sequence is planned
            # again from its prefix lookup; it then holds the pin (the adapter is resident).
            assert self._load_hook is not None, "LOAD needs a load hook"
            decision = self._load_hook(seq, needed + watermark)
            if decision is AdmitDecision.OK:
                admitted = self._admit(seq, budget, out, loaded=True)
                if not isinstance(admitted, ScheduledSeq) and self._release_hook is not None:
                    self._release_hook(seq)  # not this step after all: no pin while it waits
                return admitted
        if decision is AdmitDecision.WAIT or decision is AdmitDecision.LOAD:
            return _SKIP  # LOAD again after a load: the adapter went meanwhile; not this step
        if decision is AdmitDecision.REJECT:
            self.finish(seq, SeqStatus.FINISHED_ABORTED)
            out.aborted.append(seq)
            return _SKIP
        copies = self.kv.allocate_slots(seq.seq_id, cached, to_allocate, hit)
        assert copies is not None, "can_allocate said OK"
        seq.num_computed_tokens = cached
        if swapped is not None:
            if self.tier_io.place_swapped_tail(seq, swapped):
                seq.num_computed_tokens = resume
            else:  # a read failed (a counted miss): compute from the hit, within budget
                num_new = min(seq.num_tokens - cached, num_new)
        # Nothing below can fail: from here the sequence runs this step.
        if seq.num_preemptions == 0 and seq.index == 0:
            seq.request.num_cached_tokens = min(cached, seq.num_prompt_tokens)
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        out.block_copies.extend(copies)
        return ScheduledSeq(seq, num_new, tuple(self.kv.block_table(seq.seq_id)))


class _Skip(enum.Enum):
    SKIP = "skip"  # not now: try the next waiting sequence
    STOP = "stop"  # no memory: admit nothing more this step


_SKIP = _Skip.SKIP
_STOP = _Skip.STOP
