"""One sequence's grammar state: what it has generated so far, as the grammar sees it.

The interface speculative decoding needs is small: ``accept_tokens`` (the verified tokens, in
order; stops at the first the grammar refuses) and ``rollback(n)`` (back out the last ``n``
accepted tokens, e.g. drafts that verification refused). ``fill_mask`` writes the allowed
next tokens as llguidance's bitmask (one bit per token id, 32 to an int32 word).
"""

from __future__ import annotations

import llguidance
import torch


class GrammarState:
    """An llguidance matcher for one sequence; ``num_tokens`` counts the tokens it accepted."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._eos = eos_token_ids
        self.num_tokens = 0

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (the state unchanged) when the grammar refuses it."""
        # validate_tokens never admits EOS; EOS is valid exactly where the output is complete.
        if token_id in self._eos:
            if not self._matcher.is_accepting():
                return False
        elif self._matcher.validate_tokens([token_id]) != 1:
            return False
        ok = self._matcher.consume_token(token_id)
        if ok:
            self.num_tokens += 1
        return ok

    def accept_tokens(self, token_ids: list[int]) -> int:
        """Advance by ``token_ids`` in order; how many were accepted (it stops at the first the
        grammar refuses, which leaves the state after the accepted prefix)."""
        accepted = 0
        for token_id in token_ids:
            if not self.accept_token(token_id):
                break
            accepted += 1
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Back out the last ``num_tokens`` accepted tokens (0 <= num_tokens <= ``num_tokens``)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_tokens} accepted tokens")
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self._matcher.get_error()}")
        self.num_tokens -= num_tokens

    def copy(self) -> GrammarState:
        """An independent copy (a forked sibling continues from here on its own)."""
        twin = GrammarState(self._matcher.deep_copy(), self._eos)
        twin.num_tokens = self.num_tokens
        return twin

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, CPU, contiguous); drops the GIL."""
        view = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())

    @property
    def is_terminated(self) -> bool:
        """Nothing but EOS may follow (the grammar is complete and admits no more)."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """What was generated is a complete answer (EOS may follow)."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (it never recovers), or None."""
        return self._matcher.get_error() or None if self._matcher.is_error() else None
