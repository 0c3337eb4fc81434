"""Greedy references from HF transformers, and the rule our tokens are held to against them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Reference:
    """Greedy tokens from HF ``generate`` plus each step's logprobs (for the near-tie rule)."""

    tokens: list[int]
    step_logprobs: list[torch.Tensor]  # one [vocab] tensor per generated token


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]) -> Reference:
    """HF transformers greedy decoding of one prompt (batch 1, no padding)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=list(eos_ids),
            pad_token_id=eos_ids[0],
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [s[0].float().log_softmax(-1) for s in out.scores]
    return Reference(tokens, logprobs)


def assert_greedy_match(ours: list[int], ref: Reference, tol: float = 1e-4, what: str = "") -> None:
    """Equal token for token, except a divergence at a near tie (top-2 logprobs within ``tol``)."""
    for i, (a, b) in enumerate(zip(ours, ref.tokens, strict=False)):
        if a != b:
            top2 = ref.step_logprobs[i].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < tol, (
                f"{what}: token {i} differs ({a} vs {b}) and the reference's top-2 gap is {gap:.3g}"
            )
            return  # after a legitimate near-tie the continuations may differ
    assert len(ours) == len(ref.tokens), (
        f"{what}: lengths differ: {len(ours)} vs {len(ref.tokens)}\n{ours}\n{ref.tokens}"
    )
