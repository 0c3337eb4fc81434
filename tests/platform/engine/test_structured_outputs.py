"""Guided decoding in the engine: constraints compiled and bounded, grammar state rolled forward
and back, every output valid (greedy, sampled, n > 1, seeds, LoRA, prefix caching), and the
mask never changing a greedy token the grammar allows (fidelity)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.adapters.request import LoRARequest
from loraplex.platform.engine.errors import InvalidParameterError, StructuredOutputError
from loraplex.platform.engine.sampling_params import StructuredOutputsParams as S
from loraplex.platform.engine.structured.bounds import MAX_SCHEMA_DEPTH

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny(tiny_dirs: dict[str, Path]) -> LLM:
    return LLM(
        model=str(tiny_dirs["gqa_tied"]),
        dtype="float32",
        num_kv_blocks=256,
        block_size=8,
        max_num_seqs=16,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        enable_prefix_caching=True,
    )


def _texts(llm: LLM, prompt: str | list[int], params: SamplingParams) -> list[str]:
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert out.error is None, out.error
    return [c.text for c in out.outputs]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one"),
        ({"json": PERSON, "regex": "a"}, "exactly one"),
        ({"choice": []}, "choice"),
        ({"choice": ["a", 1]}, "choice"),
        ({"regex": ""}, "regex"),
        ({"json_object": False}, "exactly one"),
    ],
)
def test_constraint_shape_is_checked(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidParameterError, match=match):
        S(**kwargs)


@pytest.mark.slow
def test_json_schema_outputs_validate_greedy_sampled_n_seeded(tiny: LLM) -> None:
    """A random model only ever says what the grammar allows: every answer parses and validates,
    for greedy, sampled with n = 3, and the seed gives the same answers again."""
    greedy = SamplingParams(temperature=0, max_tokens=64, structured_outputs=S(json=PERSON))
    sampled = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=64, structured_outputs=S(json=PERSON))
    prompt = [5, 17, 300, 4000, 12, 9]
    for params in (greedy, sampled):
        outs = tiny.generate(prompt, params, use_tqdm=False)[0].outputs
        assert len(outs) == params.n
        for c in outs:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), PERSON)
    again = _texts(tiny, prompt, sampled)
    assert again == _texts(tiny, prompt, sampled)


def test_choice_regex_grammar_and_json_object(tiny: LLM) -> None:
    prompt = [7, 8, 9, 10]
    choice = _texts(
        tiny,
        prompt,
        SamplingParams(temperature=0.9, seed=1, n=4, structured_outputs=S(choice=["red", "green", 'a b"c'])),
    )
    assert set(choice) <= {"red", "green", 'a b"c'}
    phone = _texts(
        tiny,
        prompt,
        SamplingParams(temperature=1.0, seed=2, structured_outputs=S(regex=r"[0-9]{3}-[0-9]{4}")),
    )
    assert len(phone[0]) == 8 and phone[0][3] == "-" and phone[0].replace("-", "").isdigit()
    lark = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]{1,3}/'
    ans = _texts(
        tiny, prompt, SamplingParams(temperature=1.0, seed=3, n=4, structured_outputs=S(grammar=lark))
    )
    assert all(a in ("yes", "no") or (a.startswith("maybe ") and a[6:].isdigit()) for a in ans)
    obj = tiny.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=48, structured_outputs=S(json_object=True)),
        use_tqdm=False,
    )[0].outputs[0]
    # A random model may not close an object within max_tokens: whatever it said is a JSON prefix.
    assert obj.text.startswith("{")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)


def test_with_lora_and_prefix_cache(tiny: LLM, tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    from support.adapters import make_peft_adapter

    spec = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    make_peft_adapter(tiny_dirs["gqa_tied"], tmp_path / "a", seed=5, spec=spec)
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    prompt = list(range(100, 140))  # 5 full blocks: the second run hits the prefix cache
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=S(json=PERSON))
    first = tiny.generate(prompt, params, lora_request=lora, use_tqdm=False)[0]
    second = tiny.generate(prompt, params, lora_request=lora, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    jsonschema.validate(json.loads(first.outputs[0].text), PERSON)
    # Usage counts the tokens generated, EOS included, as without a grammar.
    assert first.outputs[0].token_ids[-1] in tiny.llm_engine.info.eos_token_ids


def test_fidelity_greedy_tokens_unchanged_when_allowed(tiny: LLM) -> None:
    """With a constraint every greedy answer satisfies, constrained tokens equal unconstrained ones."""
    prompts = [[5, 17, 300, 4000], [1000, 2000, 3000], list(range(50, 90))]
    plain = SamplingParams(temperature=0, max_tokens=24)
    anything = SamplingParams(temperature=0, max_tokens=24, structured_outputs=S(regex=r"(?s:.*)"))
    for prompt in prompts:
        free = tiny.generate(prompt, plain, use_tqdm=False)[0].outputs[0]
        bound = tiny.generate(prompt, anything, use_tqdm=False)[0].outputs[0]
        assert bound.token_ids == free.token_ids
        # A grammar that allows exactly the greedy answer (and others): same tokens again.
        exact = S(choice=[free.text, free.text + " and more", "zzz"])
        tight = tiny.generate(
            prompt, SamplingParams(temperature=0, max_tokens=24, structured_outputs=exact), use_tqdm=False
        )
        assert tight[0].outputs[0].token_ids == free.token_ids


def test_grammar_state_accepts_and_rolls_back(tiny: LLM) -> None:
    engine = tiny.llm_engine
    state = engine.grammars.compile(S(choice=["hello world", "help"])).new_state()
    ids = list(engine.tokenizer.encode("hello world", add_special_tokens=False))
    assert state.accept_tokens(ids) == len(ids) and state.is_accepting
    state.rollback(len(ids))
    assert state.num_tokens == 0 and not state.is_accepting
    bad = list(engine.tokenizer.encode("goodbye", add_special_tokens=False))
    assert state.accept_tokens(bad) == 0 and state.error is None  # refused, state intact
    assert state.accept_tokens(ids[:1]) == 1
    twin = state.copy()
    assert twin.accept_tokens(ids[1:]) == len(ids) - 1 and state.num_tokens == 1
    with pytest.raises(ValueError):
        state.rollback(2)
    mask = torch.zeros(1, engine.grammars.mask_words, dtype=torch.int32)
    twin.fill_mask(mask, 0)
    eos = engine.info.eos_token_ids[0]
    assert (int(mask[0, eos >> 5]) >> (eos & 31)) & 1  # complete: EOS allowed
    assert twin.accept_token(eos) and twin.is_terminated


def test_compiled_grammars_are_cached(tiny: LLM) -> None:
    grammars = tiny.llm_engine.grammars
    a = grammars.compile(S(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    hits = grammars.hits
    b = grammars.compile(S(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}'))
    assert b is a and grammars.hits == hits + 1


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HOSTILE = {
    "deep nesting": (_deep(MAX_SCHEMA_DEPTH * 2), "nested deeper"),
    "huge enum": ({"enum": [f"value-{i}" for i in range(200_000)]}, "bytes|too large|values"),
    "recursive $ref": (
        {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"},
        r"cannot be used: it admits no output at all: a rule that refers only to itself",
    ),
    "bad pattern": ({"type": "string", "pattern": "(((("}, "cannot be used"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_schemas_are_refused_fast(tiny: LLM, name: str) -> None:
    schema, match = HOSTILE[name]
    started = time.perf_counter()
    with pytest.raises(StructuredOutputError, match=match):
        tiny.llm_engine.add_request(
            f"hostile-{name}", [1, 2, 3], SamplingParams(structured_outputs=S(json=schema))
        )
    assert time.perf_counter() - started < 5
    assert not tiny.llm_engine.has_unfinished_requests()


def test_backtracking_pattern_compiles_and_runs(tiny: LLM) -> None:
    """``(a+)+$`` is catastrophic for a backtracking regex; llguidance's lexer has no backtracking."""
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^(a+)+$", "maxLength": 20}},
        "required": ["s"],
    }
    started = time.perf_counter()
    out = tiny.generate(
        [1, 2, 3],
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=S(json=schema)),
        use_tqdm=False,
    )[0]
    assert time.perf_counter() - started < 20
    c = out.outputs[0]
    if c.finish_reason == "stop":
        jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.slow
def test_speculative_decoding_leaves_grammar_requests_masked(tiny_dirs: dict[str, Path], tiny: LLM) -> None:
    """With ``speculative_config`` on, a request under a grammar decodes normally (drafts are not
    verified against masks): the same valid tokens as without speculation."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(
        model=str(tiny_dirs["gqa_tied"]),
        dtype="float32",
        num_kv_blocks=64,
        block_size=8,
        speculative_config=spec,
    )
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=S(json=PERSON))
    prompt = [5, 17, 300, 4000, 12, 9]
    with_spec = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    plain = tiny.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert with_spec.token_ids == plain.token_ids
    jsonschema.validate(json.loads(with_spec.text), PERSON)
