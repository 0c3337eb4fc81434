"""Swap preemption and lower-tier reads that never stall a step.

Two long generations share a pool that holds one of them, so the newer is preempted
again and again. Its full blocks stay in the prefix cache (demoted to host or disk
when the pool reuses them); its partial last block is swapped out (``preemption_mode``
"swap", or "auto" by the cost model) or recomputed. Every run's greedy tokens must
equal the engine without any cache (itself HF-exact, ``tests/platform/model``), and
the token count the engine ran through the model says whether anything was
recomputed.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from loraplex import LLM, SamplingParams
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.preemption import PreemptionPolicy

BLOCK = 8
# Lengths that put the preemption mid-block (the victim has a 7-token partial tail).
PROMPTS = [[(11 * i) % 900 + 5 for i in range(43)], [(7 * i + 3) % 900 + 5 for i in range(42)]]
LONG = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
# Every token computed once: each prompt, then one forward per generated token but the last.
NO_RECOMPUTE = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (LONG.max_tokens - 1)


def _generate(tiny_dirs: dict[str, Path], **kw: object) -> tuple[list[list[int]], LLMEngine]:
    llm = LLM(
        model=str(tiny_dirs["gqa_tied"]),
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=16,  # 128 token slots: one sequence of 43 + 70 at a time
        **kw,  # type: ignore[arg-type]
    )
    outs = llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert all(o.error is None for o in outs)
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine


@pytest.fixture(scope="module")
def expected(tiny_dirs: dict[str, Path]) -> list[list[int]]:
    tokens, engine = _generate(tiny_dirs, enable_prefix_caching=False)
    assert engine.scheduler.num_preemptions > 0, "the workload must preempt"
    return tokens


@pytest.mark.slow
def test_swap_to_host_recomputes_nothing(tiny_dirs: dict[str, Path], expected: list[list[int]]) -> None:
    got, engine = _generate(tiny_dirs, host_kv_cache_bytes=4 << 20, preemption_mode="swap")
    assert got == expected
    sched = engine.scheduler
    assert sched.num_preemptions > 0 and sched.num_swapped_out > 0
    assert sched.num_swapped_in == sched.num_swapped_out and sched.num_swaps_lost == 0
    assert engine.num_batched_tokens == NO_RECOMPUTE  # full blocks by promotion, the tail by swap-in
    assert engine.kv.tiers is not None and engine.kv.tiers.num_swapped_blocks == 0
    engine.check_integrity()


def test_recompute_mode_recomputes_the_tail(tiny_dirs: dict[str, Path], expected: list[list[int]]) -> None:
    got, engine = _generate(tiny_dirs, host_kv_cache_bytes=4 << 20, preemption_mode="recompute")
    assert got == expected
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_swapped_out == 0
    assert engine.num_batched_tokens > NO_RECOMPUTE
    engine.check_integrity()


@pytest.mark.slow
def test_swap_to_disk_reads_the_tail_back_asynchronously(
    tiny_dirs: dict[str, Path], expected: list[list[int]], tmp_path: Path
) -> None:
    """No host tier: swapped tails and evicted blocks go to disk and come back by disk reads."""
    got, engine = _generate(
        tiny_dirs,
        disk_kv_path=str(tmp_path / "kv"),
        disk_kv_cache_bytes=8 << 20,
        preemption_mode="swap",
    )
    assert got == expected
    sched = engine.scheduler
    assert sched.num_swapped_out > 0 and sched.num_swapped_in == sched.num_swapped_out
    assert engine.num_batched_tokens == NO_RECOMPUTE
    disk = {m.tier: m for m in engine.kv.tiers.metrics()}["disk"] if engine.kv.tiers else None
    assert disk is not None and disk.promotions > 0
    engine.check_integrity()
    engine.shutdown()


def test_auto_swaps_on_this_cpu(tiny_dirs: dict[str, Path], expected: list[list[int]]) -> None:
    """The cost model sees a token cost more than copying a block's share out and back."""
    got, engine = _generate(tiny_dirs, host_kv_cache_bytes=4 << 20)  # preemption_mode="auto"
    assert got == expected
    policy = engine.preemption
    assert policy.seconds_per_token is not None
    assert engine.scheduler.num_swapped_out > 0
    assert policy.swap_cost_s(1) < policy.recompute_cost_s(BLOCK - 1)  # type: ignore[operator]


def test_a_sequence_aborted_while_swapped_frees_its_tail(tiny_dirs: dict[str, Path]) -> None:
    llm = LLM(
        model=str(tiny_dirs["gqa_tied"]),
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=16,
        host_kv_cache_bytes=4 << 20,
        preemption_mode="swap",
    )
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, LONG)
    while engine.scheduler.num_swapped_out == 0:
        engine.step()
    swapped = [s for s in engine.scheduler.waiting if s.swapped is not None]
    assert swapped and engine.kv.tiers is not None and engine.kv.tiers.num_swapped_blocks > 0
    engine.abort_request(swapped[0].request.request_id)
    assert engine.kv.tiers.num_swapped_blocks == 0
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()


def test_swap_needs_a_tier() -> None:
    with pytest.raises(ValueError, match="needs a KV tier"):
        LLM(preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        LLM(preemption_mode="sometimes")  # type: ignore[arg-type]


def test_cost_model_weighs_bytes_against_tokens() -> None:
    policy = PreemptionPolicy("auto", bytes_per_block=1 << 20, can_swap=True)
    assert not policy.should_swap(7, 1), "no step observed yet: recompute"
    policy.observe_step(num_tokens=1000, seconds=1.0)  # 1 ms per token
    policy.observe_copy(num_blocks=10 << 10, seconds=1.0)  # 1 MiB blocks: ~10 GB/s, after the EMA
    assert policy.should_swap(7, 1)  # ~0.2-1 ms of copying against 7 ms of compute
    fast = PreemptionPolicy("auto", bytes_per_block=1 << 20, can_swap=True)
    fast.observe_step(num_tokens=100_000, seconds=0.01)  # 0.1 us per token (a GPU batch)
    assert not fast.should_swap(7, 1)
    assert not PreemptionPolicy("recompute", 1 << 20, can_swap=True).should_swap(7, 1)
    assert not PreemptionPolicy("auto", 1 << 20, can_swap=False).should_swap(7, 1)
    assert PreemptionPolicy("swap", 1 << 20, can_swap=True).should_swap(1, 1)
    assert not PreemptionPolicy("swap", 1 << 20, can_swap=True).should_swap(0, 0)


SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PREFIX = PROMPTS[0][:40]  # 5 full blocks


class SlowDisk:
    """The disk tier's reads wait until ``release()`` (latency injected into the real pool)."""

    def __init__(self, engine: LLMEngine) -> None:
        assert engine.kv.tiers is not None and engine.kv.tiers.disk is not None
        self.files = engine.kv.tiers.disk._files
        self.original = self.files.read_record
        self.event = threading.Event()

        def slow_read(slot: int) -> bytes:
            self.event.wait(timeout=30)
            return self.original(slot)

        self.files.read_record = slow_read  # type: ignore[method-assign]

    def release(self) -> None:
        self.event.set()
        self.files.read_record = self.original  # type: ignore[method-assign]


def _prefix_on_disk(tiny_dirs: dict[str, Path], tmp_path: Path) -> LLMEngine:
    """An engine whose pool evicted PREFIX's blocks to the disk tier (writes flushed)."""
    engine = LLM(
        model=str(tiny_dirs["gqa_tied"]),
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=12,  # the second request evicts the first one's prefix (to disk)
        disk_kv_path=str(tmp_path / "kv"),
        disk_kv_cache_bytes=8 << 20,
    ).llm_engine
    for rid, prompt in (("warm", [*PREFIX, 1]), ("evict", PROMPTS[1] + PROMPTS[1][:40])):
        engine.add_request(rid, prompt, SHORT)
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.kv.tiers is not None
    engine.kv.tiers.flush()
    return engine


@pytest.mark.slow
def test_disk_reads_do_not_stall_other_sequences(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """While a prompt's prefix is read back from disk, the engine keeps stepping the sequence
    that is already running; the prompt is admitted once its blocks have landed."""
    engine = _prefix_on_disk(tiny_dirs, tmp_path)
    disk = SlowDisk(engine)
    engine.add_request("busy", PROMPTS[1][:10], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()  # 'busy' is running
    engine.add_request("hit", [*PREFIX, 2], SHORT)
    outputs = []
    for _ in range(5):
        outputs += engine.step()  # 'hit' waits for its reads; 'busy' decodes meanwhile
    busy = [o for o in outputs if o.request_id == "busy"]
    assert len(busy) == 5 and all(len(o.outputs[0].token_ids) > 0 for o in busy)
    assert not any(o.request_id == "hit" for o in outputs)
    assert engine.scheduler.num_promotions_in_flight == 1
    engine.check_integrity()  # blocks conserved while their reads are in flight
    disk.release()
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "hit" and out.finished:
                final = out
    assert final is not None and final.num_cached_tokens == 5 * BLOCK
    assert engine.kv.tiers is not None
    # Read from disk: 4 of the 5 (the evicting request took the warm one's keyless tail block
    # first, then the 4 oldest cached blocks; the fifth stayed on the device).
    assert {m.tier: m for m in engine.kv.tiers.metrics()}["disk"].promotions >= 4
    reference = LLM(
        model=str(tiny_dirs["gqa_tied"]), dtype="float32", block_size=BLOCK, enable_prefix_caching=False
    )
    expected = reference.generate([[*PREFIX, 2]], SHORT, use_tqdm=False)[0].outputs[0].token_ids
    assert final.outputs[0].token_ids == expected
    engine.check_integrity()
    engine.shutdown()


@pytest.mark.slow
def test_a_request_aborted_during_its_reads_still_caches_the_blocks(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    engine = _prefix_on_disk(tiny_dirs, tmp_path)
    disk = SlowDisk(engine)
    engine.add_request("hit", [*PREFIX, 2], SHORT)
    engine.add_request("busy", PROMPTS[1][:10], SHORT)
    engine.step()  # 'hit' starts its reads and waits; 'busy' runs
    assert engine.scheduler.num_promotions_in_flight == 1
    engine.abort_request("hit")
    engine.check_integrity()
    # The same prefix again: it waits for the orphaned promotion (its blocks are being brought
    # up) instead of computing them, and hits them once they land.
    engine.add_request("again", [*PREFIX, 3], SHORT)
    engine.step()
    disk.release()
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "again" and out.finished:
                final = out
    assert final is not None and final.num_cached_tokens == 5 * BLOCK
    assert engine.scheduler.num_promotions_in_flight == 0
    engine.check_integrity()
    engine.shutdown()
