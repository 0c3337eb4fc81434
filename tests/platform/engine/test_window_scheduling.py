"""The scheduler with a sliding-window block manager (no model): sequences many times longer
than the pool run to the end, each holding only its window's blocks after every step; prompts
longer than the pool are cut into chunks that fit; preemption and resumption stay exact."""

from __future__ import annotations

from typing import cast

from loraplex.kernels.metadata import PAD_BLOCK_ID
from loraplex.platform.engine.detokenizer import IncrementalDetokenizer
from loraplex.platform.engine.sampling_params import SamplingParams
from loraplex.platform.engine.scheduler import Scheduler, SchedulerLimits
from loraplex.platform.engine.scheduler_output import SchedulerOutput
from loraplex.platform.engine.sequence import Request, SeqStatus, Sequence
from loraplex.storage.kv.block_manager import KVBlockManager
from loraplex.storage.kv.tiers.tiered_kv import TieredKV


def _seq(name: str, prompt_len: int, arrival: float, max_tokens: int) -> Sequence:
    req = Request(name, None, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens))
    req.arrival_time = arrival
    seq = Sequence(req, 0, list(req.prompt_token_ids), None, cast(IncrementalDetokenizer, None))
    req.seqs.append(seq)
    return seq


def _step(sched: Scheduler, step: int) -> SchedulerOutput:
    """Play the engine: the step computes its tokens, then each complete sequence samples."""
    out = sched.schedule()
    sched.update_from_output(out)
    for item in out.scheduled:
        seq = item.seq
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(1000 + step)
            if seq.num_output_tokens >= (seq.params.max_tokens or 0):
                sched.finish(seq, SeqStatus.FINISHED_LENGTH)
    return out


def test_sequences_longer_than_the_pool_hold_only_their_windows() -> None:
    # 8 blocks of 4 = 32 tokens of KV; window 8: a decode step reads at most 3 blocks.
    kv = KVBlockManager(num_blocks=8, block_size=4, sliding_window=8)
    sched = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=16), TieredKV(kv))
    a, b = _seq("A", 20, 0.0, max_tokens=200), _seq("B", 12, 1.0, max_tokens=150)
    sched.add(a)
    sched.add(b)
    step = 0
    while sched.num_unfinished:
        step += 1
        out = _step(sched, step)
        kv.check_integrity()
        for seq in sched.running:
            # After each step a sequence holds the blocks its next query reads, no more.
            table = kv.block_table(seq.seq_id)
            first = kv.first_kept_block(seq.num_computed_tokens)
            assert table[:first] == [PAD_BLOCK_ID] * first
            assert kv.num_held_blocks(seq.seq_id) == len(table) - first <= 3
        assert step < 400
        if step == 1:
            assert [(i.seq.request.request_id, i.num_new_tokens) for i in out.scheduled] == [("A", 16)]
    # 220 and 162 tokens: 55 and 41 blocks without a window, 12 times the pool together.
    assert (a.num_tokens, b.num_tokens) == (220, 162)
    assert a.status is b.status is SeqStatus.FINISHED_LENGTH
    assert sched.num_preemptions == 0
    assert kv.num_free_blocks == 8 and kv.num_window_freed_blocks > 80


def test_prompt_longer_than_the_pool_runs_in_chunks_that_fit() -> None:
    kv = KVBlockManager(num_blocks=8, block_size=4, sliding_window=8)
    # A 32-token budget, but a chunk and the window before it must fit 8 blocks: 22 tokens.
    sched = Scheduler(SchedulerLimits(max_num_seqs=2, max_num_batched_tokens=32), TieredKV(kv))
    seq = _seq("long", 60, 0.0, max_tokens=3)
    sched.add(seq)
    chunks = []
    for step in range(1, 10):
        if not sched.num_unfinished:
            break
        out = _step(sched, step)
        chunks.append(out.scheduled[0].num_new_tokens)
        kv.check_integrity()
    assert chunks == [22, 22, 16, 1, 1]
    assert seq.status is SeqStatus.FINISHED_LENGTH and kv.num_free_blocks == 8


def test_preempted_windowed_sequence_recomputes_and_continues() -> None:
    # Two long sequences in 5 blocks: a decode step needs 2 or 3 blocks each, so when both
    # need 3 one is preempted; it recomputes from the start in chunks (at most 10 tokens:
    # 5 * 4 - 8 - 4 + 2) and still holds only its window's blocks.
    kv = KVBlockManager(num_blocks=5, block_size=4, sliding_window=8)
    sched = Scheduler(SchedulerLimits(max_num_seqs=3, max_num_batched_tokens=12), TieredKV(kv))
    seqs = [_seq(name, 10, float(i), max_tokens=60) for i, name in enumerate("AB")]
    for seq in seqs:
        sched.add(seq)
    step = 0
    while sched.num_unfinished:
        step += 1
        _step(sched, step)
        kv.check_integrity()
        for seq in sched.running:
            assert kv.num_held_blocks(seq.seq_id) <= 3
        assert step < 1000
    assert all(s.status is SeqStatus.FINISHED_LENGTH and s.num_tokens == 70 for s in seqs)
    assert sched.num_preemptions > 0
    assert kv.num_free_blocks == 5
