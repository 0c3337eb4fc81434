"""Adapter-aware scheduling: no head-of-line blocking, bounded wait for a slot."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
from support.engines import tiny_engine

from loraplex import LLM, LoRARequest, SamplingParams


@pytest.fixture(scope="module")
def three_adapters(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    from support.adapters import make_peft_adapter

    root = tmp_path_factory.mktemp("sched-adapters")
    out = []
    for i in range(3):
        make_peft_adapter(
            tiny_dirs["gqa_tied"], root / f"s{i}", seed=500 + i, spec=dict(r=4, target_modules=["q_proj"])
        )
        out.append(LoRARequest(f"sched-{i}", 10 + i, str(root / f"s{i}")))
    return out


_engine = partial(
    tiny_engine, enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=512, max_num_seqs=16
)


def test_blocked_adapter_does_not_block_others(
    tiny_dirs: dict[str, Path], three_adapters: list[LoRARequest]
) -> None:
    a, b, c = three_adapters
    engine = _engine(tiny_dirs)
    long = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], long, lora_request=a)
    engine.add_request("b", [5, 6, 7], long, lora_request=b)
    engine.step()  # a and b pin both slots
    engine.add_request("c", [5, 6, 7], long, lora_request=c)
    engine.add_request("base", [5, 6, 7], long)
    engine.add_request("a2", [8, 9], long, lora_request=a)
    started = {o.request_id for o in engine.step()}
    # c waits for a slot, but the base request and another request for resident a run.
    assert "c" not in started
    assert {"base", "a2"} <= started
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()


def test_no_starvation_under_constant_load(
    tiny_dirs: dict[str, Path], three_adapters: list[LoRARequest]
) -> None:
    """Requests for resident adapters keep arriving; the third adapter still gets a slot
    within the time its competitors need to finish (bounded by max_tokens)."""
    a, b, c = three_adapters
    engine = _engine(tiny_dirs)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request("a0", [5, 6, 7], params, lora_request=a)
    engine.add_request("b0", [5, 6, 7], params, lora_request=b)
    engine.step()
    engine.add_request("c", [5, 6, 7], params, lora_request=c)
    c_started_at = None
    for step in range(1, 200):
        # Constant competition for the two resident adapters.
        engine.add_request(f"a{step}", [5, 6, 7], params, lora_request=a)
        engine.add_request(f"b{step}", [5, 6, 7], params, lora_request=b)
        outs = engine.step()
        if any(o.request_id == "c" for o in outs):
            c_started_at = step
            break
    assert c_started_at is not None, "adapter c starved"
    grace = engine.lora_runtime.admission.drain_after_steps
    assert c_started_at <= grace + 2 * params.max_tokens + 4, f"c waited {c_started_at} steps"
    for rid in list(engine.requests):
        engine.abort_request(rid)
    engine.check_integrity()
    assert engine.lora_runtime.num_pins == 0


@pytest.mark.slow
def test_adapters_of_waiting_requests_are_read_ahead(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A request whose adapter is only in the store has it read in the background while it
    still queues behind a full batch, not only once admission reaches it."""
    import time

    from support.adapters import make_peft_adapter

    loras = []
    for i in range(5):
        make_peft_adapter(
            tiny_dirs["gqa_tied"], tmp_path / f"r{i}", seed=600 + i, spec=dict(r=4, target_modules=["q_proj"])
        )
        loras.append(LoRARequest(f"ahead-{i}", 40 + i, str(tmp_path / f"r{i}")))
    probe = LLM(model=str(tiny_dirs["gqa_tied"]), dtype="float32", enable_lora=True, max_lora_rank=8)
    probe.llm_engine.add_lora(loras[0])
    one = probe.llm_engine.lora_runtime.adapter_manager.stats().host_bytes
    llm = LLM(
        model=str(tiny_dirs["gqa_tied"]),
        dtype="float32",
        enable_lora=True,
        max_lora_rank=8,
        num_kv_blocks=512,
        max_num_seqs=1,
        cpu_lora_memory=int(2.5 * one),  # the host LRU keeps the last two registered
    )
    engine = llm.llm_engine
    for lora in loras:
        engine.add_lora(lora)
    manager = engine.lora_runtime.adapter_manager
    assert manager.stats().num_in_host == 2  # adapters 0..2 are in the store only
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request("first", [5, 6, 7], params, lora_request=loras[4])
    engine.add_request("next", [5, 6, 7], params, lora_request=loras[0])
    engine.step()  # "first" runs alone; admission never reaches "next" (max_num_seqs=1)
    stats = manager.stats()
    assert stats.num_loading + stats.num_disk_reads == 1, "the waiting request's adapter was not read ahead"
    assert "next" in engine.requests and manager.slot_of(loras[0].int_id) is None
    deadline = time.monotonic() + 30
    while not manager.prefetch(loras[0].int_id):  # True once the read landed in host memory
        assert time.monotonic() < deadline
        time.sleep(0.01)
    reads = manager.stats().num_disk_reads
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert manager.stats().num_disk_reads == reads  # admission found it in host memory


def test_an_idle_step_waits_for_the_adapter_read(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A lone request whose adapter is only in the store: the step blocks on the background
    read instead of returning empty (a caller spinning on empty steps would starve the loader
    thread of the GIL), and the same step runs the request."""
    from support.adapters import make_peft_adapter

    loras = []
    for i in range(2):
        make_peft_adapter(
            tiny_dirs["gqa_tied"], tmp_path / f"w{i}", seed=700 + i, spec=dict(r=4, target_modules=["q_proj"])
        )
        loras.append(LoRARequest(f"idle-{i}", 60 + i, str(tmp_path / f"w{i}")))
    llm = LLM(
        model=str(tiny_dirs["gqa_tied"]),
        dtype="float32",
        enable_lora=True,
        max_lora_rank=8,
        num_kv_blocks=64,
        max_cpu_loras=1,  # registering the second pushes the first out of host memory
    )
    engine = llm.llm_engine
    for lora in loras:
        engine.add_lora(lora)
    assert engine.lora_tiers()[loras[0].int_id] == "disk"
    engine.lora_runtime.idle_wait_s = 30.0  # generous: the read takes milliseconds
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request("cold", [5, 6, 7], params, lora_request=loras[0])
    outs = engine.step()
    assert [o.request_id for o in outs] == ["cold"] and len(outs[0].outputs[0].token_ids) == 1
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
