"""``TokenText``: the text of single tokens for logprobs, cached per server (one tokenizer)."""

from __future__ import annotations

from typing import Any

from loraplex.platform.engine.outputs import Logprob


class TokenText:
    """Text of single tokens, cached (the engine's ``decoded_token`` when it has one)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int, lp: Logprob | None = None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        text = self._cache.get(token_id)
        if text is None:
            text = str(self._tokenizer.decode([token_id]))
            self._cache[token_id] = text
        return text
