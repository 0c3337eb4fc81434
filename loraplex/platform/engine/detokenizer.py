"""Incremental detokenization that only ever emits complete UTF-8 text.

Decoding token by token breaks on two things: byte-level BPE splits one character
over several tokens (the partial decode ends in U+FFFD), and SentencePiece drops
the leading space of a window that starts mid-text. So we decode a sliding window
``[prefix_offset:]`` and emit only what it adds beyond ``[prefix_offset:read_offset]``
once it no longer ends in a replacement character (vLLM's scheme). The window
starts a few prompt tokens back to give SentencePiece its context.

Stop strings are matched on the accumulated text; the stream holds back the last
``max_stop_len - 1`` characters so a stop string that spans tokens is never
half-emitted.
"""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Accumulates one sequence's output text as tokens arrive."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self._streamed = 0  # characters already handed out by take_delta()

    def clone(self) -> IncrementalDetokenizer:
        twin = IncrementalDetokenizer.__new__(IncrementalDetokenizer)
        twin.__dict__.update(self.__dict__)
        twin._ids = list(self._ids)
        return twin

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def append(self, token_id: int) -> str | None:
        """Add one token; return the stop string if the text now contains one.

        On a match, ``text`` is cut before it (or after it, with
        ``include_stop_str_in_output``) and the caller finishes the sequence.
        """
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # an incomplete character: wait for the next token
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        start = len(self.text)
        self.text += delta
        if not self.stop:
            return None
        longest = max(len(s) for s in self.stop)
        search_from = max(0, start - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = self.text.find(s, search_from)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        pos, s = best
        self.text = self.text[: pos + len(s)] if self.include_stop else self.text[:pos]
        return s

    def take_delta(self, finished: bool) -> str:
        """Text not yet streamed; holds back a possible stop-string prefix until finished."""
        hold = 0 if finished or not self.stop else max(len(s) for s in self.stop) - 1
        end = max(self._streamed, len(self.text) - hold)
        delta = self.text[self._streamed : end]
        self._streamed = end
        return delta
