"""The scheduler on its own (no model): a scripted run with exact admissions, chunks, blocks,
preemption victims and resumption.

Setting: 6 KV blocks of 4 tokens, at most 3 sequences and 8 tokens per step, FCFS.
Requests A (5-token prompt, max_tokens 5), B (6 tokens) and C (4 tokens) arrive in that
order. ``_run_step`` plays the engine: it marks the scheduled tokens computed, and each
sequence whose known tokens are now all computed "samples" one token.

| step | scheduled (name:tokens [blocks])              | what happens                              |
|------|-----------------------------------------------|-------------------------------------------|
| 1    | A:5 [0,1], B:3 [2]                            | A whole prompt, B a 3-token chunk; C waits |
| 2    | A:1 [0,1], B:3 [2,3], C:4 [4]                 | A decodes, B's last chunk, C admitted      |
| 3    | A:1, B:1, C:1 [4,5]                           | three decodes; the pool is now full        |
| 4    | A:1, B:1, C:1                                 |                                            |
| 5    | A:1 [0,1,4], B:1 [2,3,5]                      | A needs a block: C is preempted; A ends   |
| 6    | B:1 [2,3,5], C:7 [0,1]                        | C resumes, recomputing its 7 tokens        |

Free blocks without a cached key are handed out lowest id first (the pool's top stays free
for the adapter page arena).
"""

from __future__ import annotations

from typing import cast

from loraplex.platform.engine.detokenizer import IncrementalDetokenizer
from loraplex.platform.engine.sampling_params import SamplingParams
from loraplex.platform.engine.scheduler import Scheduler, SchedulerLimits
from loraplex.platform.engine.sequence import Request, SeqStatus, Sequence
from loraplex.storage.kv.block_manager import KVBlockManager
from loraplex.storage.kv.tiers.tiered_kv import TieredKV


def _seq(name: str, prompt_len: int, arrival: float, max_tokens: int = 100) -> Sequence:
    req = Request(name, None, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens))
    req.arrival_time = arrival
    # The scheduler never touches the detokenizer: no tokenizer needed here.
    seq = Sequence(req, 0, list(req.prompt_token_ids), None, cast(IncrementalDetokenizer, None))
    req.seqs.append(seq)
    return seq


def _run_step(sched: Scheduler, step: int) -> list[tuple[str, int, tuple[int, ...]]]:
    out = sched.schedule()
    plan = [(item.seq.request.request_id, item.num_new_tokens, item.block_ids) for item in out.scheduled]
    for item in out.scheduled:
        seq = item.seq
        seq.num_computed_tokens += item.num_new_tokens
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(1000 + step)
            if seq.num_output_tokens >= (seq.params.max_tokens or 0):
                sched.finish(seq, SeqStatus.FINISHED_LENGTH)
    return plan


def test_scripted_admission_chunks_preemption_and_resumption() -> None:
    kv = KVBlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(SchedulerLimits(max_num_seqs=3, max_num_batched_tokens=8), TieredKV(kv))
    a, b, c = _seq("A", 5, 0.0, max_tokens=5), _seq("B", 6, 1.0), _seq("C", 4, 2.0)
    for seq in (a, b, c):
        sched.add(seq)

    assert _run_step(sched, 1) == [("A", 5, (0, 1)), ("B", 3, (2,))]
    assert [s.request.request_id for s in sched.waiting] == ["C"]
    assert (a.num_output_tokens, b.num_computed_tokens) == (1, 3)

    assert _run_step(sched, 2) == [("A", 1, (0, 1)), ("B", 3, (2, 3)), ("C", 4, (4,))]
    assert sched.waiting == [] and [s.request.request_id for s in sched.running] == ["A", "B", "C"]

    assert _run_step(sched, 3) == [("A", 1, (0, 1)), ("B", 1, (2, 3)), ("C", 1, (4, 5))]
    assert kv.num_free_blocks == 0
    assert _run_step(sched, 4) == [("A", 1, (0, 1)), ("B", 1, (2, 3)), ("C", 1, (4, 5))]

    # A's 9th token needs a third block: the newest running sequence (C) gives its
    # blocks back (4 and 5, handed out lowest first) and waits at the head.
    assert _run_step(sched, 5) == [("A", 1, (0, 1, 4)), ("B", 1, (2, 3, 5))]
    assert c.status is SeqStatus.WAITING and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert a.status is SeqStatus.FINISHED_LENGTH and a.num_output_tokens == 5
    kv.check_integrity()

    # A's blocks came back (0, 1, 4); C recomputes prompt + its 2 sampled tokens.
    assert _run_step(sched, 6) == [("B", 1, (2, 3, 5)), ("C", 7, (0, 1))]
    assert c.status is SeqStatus.RUNNING and (c.num_computed_tokens, c.num_tokens) == (7, 8)
    assert _run_step(sched, 7) == [("B", 1, (2, 3, 5)), ("C", 1, (0, 1))]
    kv.check_integrity()


def test_waiting_sequence_that_does_not_fit_blocks_later_ones_fcfs() -> None:
    """Memory admission is strictly FCFS: a waiting sequence that does not fit now stops
    admission, so a later, smaller one cannot overtake it (no starvation of long prompts)."""
    kv = KVBlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=32), TieredKV(kv))
    big, long_, small = _seq("big", 12, 0.0, max_tokens=1), _seq("long", 9, 1.0), _seq("small", 2, 2.0)
    for seq in (big, long_, small):
        sched.add(seq)
    assert _run_step(sched, 1) == [("big", 12, (0, 1, 2))]
    assert [s.request.request_id for s in sched.waiting] == ["long", "small"]
    # big finished (max_tokens=1) and freed its blocks; they go out lowest first, then 3.
    assert _run_step(sched, 2) == [("long", 9, (0, 1, 2)), ("small", 2, (3,))]
