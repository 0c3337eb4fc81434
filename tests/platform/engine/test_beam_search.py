"""Beam search: HF ``generate(num_beams=W)``'s beams, in its order, on forked copy-on-write blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex import LLM, BeamSearchParams
from loraplex.platform.engine.beam_search import BeamSearch
from loraplex.platform.engine.errors import InvalidParameterError


@pytest.fixture(scope="module")
def model_dir(tiny_dirs: dict[str, Path]) -> Path:
    return tiny_dirs["gqa_tied"]


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_beams(
    model: Any, prompt: list[int], width: int, max_new: int, length_penalty: float = 1.0
) -> list[list[int]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            num_beams=width,
            num_return_sequences=width,
            length_penalty=length_penalty,
            eos_token_id=2,
            pad_token_id=2,
        )
    beams = []
    for row in out.tolist():
        gen = row[len(prompt) :]
        if 2 in gen:  # HF pads after EOS
            gen = gen[: gen.index(2) + 1]
        beams.append(gen)
    return beams


PROMPTS = [
    [1, 504, 3103, 282, 4649, 314, 2711, 30, 378, 260, 1345],
    [1, 7340, 28, 957, 314, 260, 2432, 6393, 90, 1128, 338, 3445, 2521, 30, 216, 34, 35],
]


@pytest.mark.slow
@pytest.mark.parametrize("width", [2, 4, 8])
def test_beams_equal_hf(model_dir: Path, hf_model: Any, width: int) -> None:
    # A small chunk budget: prompts are prefilled in chunks, beams decode together.
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        num_kv_blocks=128,
        block_size=8,
        max_num_batched_tokens=16,
        max_num_seqs=16,
    )
    params = BeamSearchParams(beam_width=width, max_tokens=10)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = hf_beams(hf_model, prompt, width, 10)
        ours = [s.tokens[len(prompt) :] for s in out.sequences]
        assert ours == ref, f"W={width}\nours {ours}\nHF   {ref}"
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        for s in out.sequences:
            assert s.cum_logprob == pytest.approx(sum(s.logprobs), abs=1e-4)
    assert not llm.llm_engine.has_unfinished_requests()
    assert (
        llm.llm_engine.kv.block_manager.num_free_blocks == 128
    )  # every beam's blocks came back (cached ones are free)


def test_length_penalty(model_dir: Path, hf_model: Any) -> None:
    """Length penalties other than 1 (these prompts' beams all run to max_tokens)."""
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64, block_size=8)
    for lp in (0.0, 2.0):
        for prompt in PROMPTS:
            out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(4, 12, length_penalty=lp))[
                0
            ]
            ref = hf_beams(hf_model, prompt, 4, 12, length_penalty=lp)
            assert [s.tokens[len(prompt) :] for s in out.sequences] == ref


def test_beams_share_blocks(model_dir: Path) -> None:
    """Beams fork the prompt's blocks: the KV in use stays well under W separate copies, and the
    pool is consistent after every step."""
    width, block = 8, 8
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=256, block_size=block)
    engine = llm.llm_engine
    prompt = list(range(100, 164))  # 64 tokens: 8 full blocks
    search = BeamSearch(engine, [prompt], BeamSearchParams(beam_width=width, max_tokens=12))
    peak = 0
    while not search.finished:
        search.step()
        engine.check_integrity()
        live = search.searches[0].beams if not search.searches[0].done else []
        if len(live) == width:
            in_use = engine.kv.block_manager.num_blocks - engine.kv.block_manager.num_free_blocks
            peak = max(peak, in_use)
            longest = max(b.seq.num_tokens for b in live)
            separate = width * -(-longest // block)
            assert in_use < separate / 2, f"{in_use} blocks in use vs {separate} for separate copies"
    assert peak > 0
    assert len(search.outputs()[0].sequences) == width
    assert engine.kv.block_manager.num_free_blocks == engine.kv.block_manager.num_blocks


def test_text_prompts_and_preemption(model_dir: Path) -> None:
    """A pool too small for every beam at once: beams are preempted and recomputed, and the
    results equal those of a roomy pool."""
    prompts = ["The quick brown fox jumps over", "Once upon a time in a land far"]
    params = BeamSearchParams(beam_width=4, max_tokens=20)
    roomy = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128, block_size=8)
    tight = LLM(
        model=str(model_dir), dtype="float32", num_kv_blocks=6, block_size=8, enable_prefix_caching=False
    )
    want = roomy.beam_search(prompts, params)
    engine = tight.llm_engine
    search = BeamSearch(engine, list(prompts), params)
    while not search.finished:
        search.step()
        engine.check_integrity()
    got = search.outputs()
    assert engine.scheduler.num_preemptions > 0
    for a, b in zip(want, got, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert all(isinstance(s.text, str) for s in b.sequences)


def test_bad_params() -> None:
    with pytest.raises(InvalidParameterError):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(InvalidParameterError):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5)


@pytest.mark.slow
def test_eos_beams_equal_hf(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A model steered to EOS (its output row scaled up): beams end early, finished hypotheses
    compete with running beams, and the result is still HF's, in HF's order."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["mha_untied"], dtype=torch.float32).eval()
    with torch.no_grad():
        hf.lm_head.weight[2] *= 4.0
    hf.save_pretrained(tmp_path / "eos")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "eos" / name).write_bytes((tiny_dirs["mha_untied"] / name).read_bytes())
    llm = LLM(model=str(tmp_path / "eos"), dtype="float32", num_kv_blocks=128, block_size=8)
    ended = 0
    for lp in (1.0, 0.5):
        for seed in range(6):
            prompt = [
                1,
                *torch.randint(100, 4000, (8,), generator=torch.Generator().manual_seed(seed)).tolist(),
            ]
            out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(4, 10, length_penalty=lp))[
                0
            ]
            ref = hf_beams(hf, prompt, 4, 10, length_penalty=lp)
            ours = [s.tokens[len(prompt) :] for s in out.sequences]
            assert ours == ref, f"lp={lp} seed={seed}\nours {ours}\nHF   {ref}"
            ended += sum(s.finish_reason == "stop" for s in out.sequences)
    assert ended > 0, "no beam met EOS: the test would not cover it"
