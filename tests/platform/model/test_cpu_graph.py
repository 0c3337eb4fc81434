"""The CPU graph (the layers as prebound C calls) against the layer-by-layer path it replaces.

Same kernels, same order, same arguments: every logprob the engine reports must be equal
bit for bit with and without ``enforce_eager``, on every tiny model shape (MHA, GQA,
tied embeddings, q/k/v bias, Qwen2, Qwen3's q/k norms, llama3 RoPE scaling) and on batches that mix decodes,
prefill chunks and prefix-cache hits in one step, and with LoRA adapters in the batch.
A graph that is not in use would pass that trivially, so each test also checks it is on.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from support.adapters import make_peft_adapter

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.kernels.cpu import build
from loraplex.kernels.cpu.paged_extend import worth_it

pytestmark = pytest.mark.skipif(
    build.load_library() is None or not worth_it(),
    reason="the CPU graph needs the C kernels with register tiles",
)

TINY = ["mha_untied", "gqa_tied", "gqa3_bias", "qwen2", "llama3_rope"]


def _workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts sharing prefixes (cache hits) of assorted lengths, greedy with top-5 logprobs."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 49152) for _ in range(40)]
    prompts = []
    for i in range(12):
        own = [rng.randrange(3, 49152) for _ in range(rng.randint(1, 30))]
        prompts.append(shared[: rng.choice([0, 17, 40])] + own if i % 3 else own)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(3, 9), logprobs=5, ignore_eos=True)]
    return prompts, params * len(prompts)


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], **kw: Any) -> list[Any]:
    return [
        (o.outputs[0].token_ids, o.outputs[0].cumulative_logprob, o.outputs[0].logprobs, o.num_cached_tokens)
        for o in llm.generate(prompts, params, **kw)
    ]


def _adapter(base: Path, out: Path, seed: int, spec: dict[str, Any]) -> Path:
    make_peft_adapter(base, out, seed=seed, spec=spec)
    return out


def _engines(model_dir: Path, **kw: Any) -> tuple[LLM, LLM]:
    graph = LLM(model=str(model_dir), dtype="float32", **kw)
    eager = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, **kw)
    assert graph.llm_engine.runner.graph_off_reason == ""
    assert eager.llm_engine.runner.graph_off_reason == "enforce_eager"
    return graph, eager


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY)
def test_graph_equals_layer_by_layer(name: str, tiny_dirs: dict[str, Path]) -> None:
    """Mixed steps (small token budget: chunks next to decodes), prefix hits: identical logprobs."""
    prompts, params = _workload(seed=len(name))
    graph, eager = _engines(
        tiny_dirs[name], num_kv_blocks=96, block_size=8, max_num_seqs=6, max_num_batched_tokens=24
    )
    got, want = _run(graph, prompts, params), _run(eager, prompts, params)
    assert got == want
    assert any(cached > 0 for *_, cached in got), "the workload should hit the prefix cache"


@pytest.mark.slow
def test_qwen3_runs_in_the_graph_and_equals_layer_by_layer(smollm2_dir: Path, tmp_path: Path) -> None:
    """Qwen3's per-head q/k norms are two kernel calls of the graph (the layer path's same two):
    identical logprobs, a windowed-layer mix included, with the graph on."""
    from support.models import make_tiny_family_dir

    model = make_tiny_family_dir(tmp_path / "qwen3", smollm2_dir, "qwen3", seed=5)
    prompts, params = _workload(seed=3)
    graph, eager = _engines(model, num_kv_blocks=96, block_size=8, max_num_seqs=6, max_num_batched_tokens=24)
    assert graph.llm_engine.arch.qk_norm
    assert _run(graph, prompts, params) == _run(eager, prompts, params)


@pytest.mark.slow
def test_graph_with_lora_equals_layer_by_layer(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Adapters on every projection group and base requests in the same steps."""
    base = tiny_dirs["gqa3_bias"]
    spec = dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    loras = [LoRARequest(f"a{i}", i + 1, str(_adapter(base, tmp_path / f"a{i}", i, spec))) for i in range(2)]
    prompts, params = _workload(seed=7)
    which = [loras[i % 3] if i % 3 < 2 else None for i in range(len(prompts))]
    graph, eager = _engines(
        base,
        num_kv_blocks=96,
        block_size=8,
        max_num_seqs=6,
        max_num_batched_tokens=32,
        enable_lora=True,
        max_loras=2,
    )
    got = _run(graph, prompts, params, lora_request=which)
    assert got == _run(eager, prompts, params, lora_request=which)
    base_only = _run(graph, prompts, params)
    assert any(a[0] != b[0] for a, b in zip(got, base_only, strict=True)), "the adapters should change tokens"
    counted = graph.llm_engine.runner.model.cpu_graph
    assert counted is not None and counted.lora_steps["c"] > 0 and counted.lora_steps["hook"] == 0


@pytest.mark.slow
def test_graph_serves_mixed_ranks_and_base_without_leaving(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Adapters of ranks 4, 8 and 16 (one, one and two pages: unpadded) on different projection
    groups, and base requests, in the same steps: every step with adapters runs its LoRA as
    prebound C calls inside the graph (``lora_steps``), with the layer-by-layer path's logprobs."""
    base = tiny_dirs["gqa_tied"]
    specs = [
        dict(
            r=16,
            lora_alpha=32,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
        dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        dict(r=4, lora_alpha=16, target_modules=["o_proj", "down_proj"]),
    ]
    loras = [
        LoRARequest(f"m{i}", i + 1, str(_adapter(base, tmp_path / f"m{i}", 10 + i, spec)))
        for i, spec in enumerate(specs)
    ]
    prompts, params = _workload(seed=11)
    which = [None if i % 4 == 3 else loras[i % 4] for i in range(len(prompts))]
    graph, eager = _engines(
        base,
        num_kv_blocks=128,
        block_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=40,
        enable_lora=True,
        max_lora_rank=16,
        lora_page_rank=8,
    )
    counted = graph.llm_engine.runner.model.cpu_graph
    assert counted is not None
    got = _run(graph, prompts, params, lora_request=which)
    assert got == _run(eager, prompts, params, lora_request=which)
    steps = graph.llm_engine.num_steps
    assert counted.lora_steps["hook"] == 0
    assert 0 < counted.lora_steps["c"] <= steps
    assert eager.llm_engine.runner.model.cpu_graph is None
    # The adapters did something: base-only tokens differ for the adapter requests ...
    base_only = _run(graph, prompts, params)
    differs = [a[0] != b[0] for a, b, w in zip(got, base_only, which, strict=True) if w is not None]
    assert any(differs)
    # ... and the base requests next to them got none (greedy tokens; the last bits of a logprob
    # depend on the batch's shape).
    assert all(a[0] == b[0] for a, b, w in zip(got, base_only, which, strict=True) if w is None)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        (dict(dtype="bfloat16"), "float32"),
        (dict(linear_backend="torch"), "linear"),
        (dict(attention_backend="torch"), "attention"),
    ],
)
def test_graph_stays_off_where_a_part_is_not_c(
    kw: dict[str, Any], reason: str, tiny_dirs: dict[str, Path]
) -> None:
    llm = LLM(model=str(tiny_dirs["gqa_tied"]), **{"dtype": "float32", "num_kv_blocks": 32, **kw})
    assert reason in llm.llm_engine.runner.graph_off_reason
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


def test_graph_refuses_a_cache_of_another_dtype(tiny_dirs: dict[str, Path]) -> None:
    """A cache the graph was not built for is an error, not a misread."""
    from loraplex.storage.kv.kv_cache import KVCache

    llm = LLM(model=str(tiny_dirs["gqa_tied"]), dtype="float32", num_kv_blocks=32)
    runner = llm.llm_engine.runner
    wrong = KVCache(
        runner.model.arch.num_layers,
        4,
        16,
        runner.model.arch.num_kv_heads,
        runner.model.arch.head_dim,
        torch.bfloat16,
        torch.device("cpu"),
    )
    graph = runner.model._graph
    assert graph is not None
    with pytest.raises(ValueError, match="does not fit the CPU graph"):
        graph._cache_pointers(wrong)
