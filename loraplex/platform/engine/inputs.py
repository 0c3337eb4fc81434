"""What a request gives the engine to run: its prompt, as text or as token ids."""

from __future__ import annotations

PromptType = str | list[int]
"""One prompt as the engine takes it: text (tokenized by the engine's tokenizer) or token ids
(vLLM's name for the same union)."""
