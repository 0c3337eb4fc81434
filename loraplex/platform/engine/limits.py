"""``EngineLimits``: what a running engine accepts, as the server needs to know it.

Read once from the engine when the server starts (none of it changes while the engine
runs), so the HTTP layer can check and size requests without reaching into the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loraplex.platform.model.source import model_display_name

if TYPE_CHECKING:
    from loraplex.platform.engine.engine import LLMEngine


@dataclass(frozen=True)
class EngineLimits:
    """The model's and the engine's limits."""

    model_name: str
    """The model folder's (or GGUF file's) name: the default served model name."""
    max_model_len: int
    """Longest prompt + output, in tokens."""
    max_num_seqs: int
    """Most sequences in one step (a request's ``n`` counts each)."""
    max_logprobs: int
    """Most logprobs one request may ask for."""
    vocab_size: int
    enable_lora: bool
    """Whether requests may name adapters."""
    max_lora_rank: int
    """Largest adapter rank accepted."""
    dtype: torch.dtype
    """The serving dtype: adapter weights must fit it."""
    block_size: int = 16
    """Tokens per KV block (the tiers count blocks; metrics report tokens)."""

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineLimits:
        config = engine.config
        return cls(
            model_name=model_display_name(config.model),
            max_model_len=engine.info.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_logprobs=config.max_logprobs,
            vocab_size=engine.arch.vocab_size,
            enable_lora=config.enable_lora,
            max_lora_rank=config.max_lora_rank,
            dtype=engine.info.dtype,
            block_size=config.block_size,
        )
