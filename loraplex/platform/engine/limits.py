"""``EngineLimits``: what a running engine accepts, as the server needs to know it.

Built once by the engine (``LLMEngine.limits``; none of it changes while the engine runs): the
engine checks each request against it, and the HTTP layer sizes requests by it without reaching
into the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    eos_token_ids: tuple[int, ...] = ()
    """The model's end-of-sequence tokens (generation stops at them unless ``ignore_eos``)."""
