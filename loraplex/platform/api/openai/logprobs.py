"""The engine's per-token logprobs in OpenAI's two shapes.

The engine gives, per generated token, a dict token_id -> ``Logprob`` holding the
sampled token (with its true rank) and the top-k alternatives (ranks 1..k).

- completions (legacy): ``{tokens, token_logprobs, top_logprobs, text_offset}``;
  ``top_logprobs`` holds the sampled token and the top ``logprobs`` (so up to k + 1
  entries, as OpenAI documents);
- chat: ``content: [{token, logprob, bytes, top_logprobs: [the top k]}]``.

JSON has no -inf, so logprobs are floored at -9999.0 (what vLLM does).
"""

from __future__ import annotations

import math
from typing import Any

from loraplex.platform.api.token_text import TokenText
from loraplex.platform.engine.outputs import Logprob

_FLOOR = -9999.0


def _value(lp: Logprob) -> float:
    return lp.logprob if math.isfinite(lp.logprob) and lp.logprob > _FLOOR else _FLOOR


def _by_rank(step: dict[int, Logprob], sampled: int) -> list[tuple[int, Logprob]]:
    """The sampled token first, then the alternatives by rank."""
    others = sorted(((t, lp) for t, lp in step.items() if t != sampled), key=lambda e: e[1].rank or 0)
    return ([(sampled, step[sampled])] if sampled in step else []) + others


def completion_logprobs(
    text_of: TokenText, token_ids: list[int], steps: list[dict[int, Logprob]], text_offset: int
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for ``token_ids``, offsets from ``text_offset``."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, step in zip(token_ids, steps, strict=False):
        sampled = step.get(token_id)
        text = text_of(token_id, sampled)
        tokens.append(text)
        token_logprobs.append(_value(sampled) if sampled is not None else None)
        top.append({text_of(t, lp): _value(lp) for t, lp in _by_rank(step, token_id)})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(
    text_of: TokenText, token_ids: list[int], steps: list[dict[int, Logprob]], num_top: int
) -> list[dict[str, Any]]:
    """The chat ``logprobs.content`` entries for ``token_ids`` with ``num_top`` alternatives each."""
    content = []
    for token_id, step in zip(token_ids, steps, strict=False):
        sampled = step.get(token_id)
        text = text_of(token_id, sampled)
        alternatives = sorted(
            ((t, lp) for t, lp in step.items() if lp.rank is not None and lp.rank <= num_top),
            key=lambda e: e[1].rank or 0,
        )
        content.append(
            {
                "token": text,
                "logprob": _value(sampled) if sampled is not None else _FLOOR,
                "bytes": tuple(text.encode("utf-8")),  # a JSON list; a tuple of ints is not GC-tracked
                "top_logprobs": [
                    {
                        "token": text_of(t, lp),
                        "logprob": _value(lp),
                        "bytes": tuple(text_of(t, lp).encode("utf-8")),
                    }
                    for t, lp in alternatives[:num_top]
                ],
            }
        )
    return content
