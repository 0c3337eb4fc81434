"""From what a caller sends to a validated ``Request`` and its sequences.

Everything a request carries is checked here, against the model and the engine's limits,
before anything is queued: its prompt, its sampling parameters, its output constraint
(compiled, or found in the compiler's cache) and its adapter (resolved, loaded on first use).
The sequences of a request, its first one and the siblings forked from it (``n > 1``, beam
search), are made here too, each with its own detokenizer, seed and grammar state.
"""

from __future__ import annotations

from typing import Any

import torch

from loraplex.adapters.request import LoRARequest
from loraplex.platform.engine.detokenizer import IncrementalDetokenizer
from loraplex.platform.engine.errors import AdapterUnavailableError, InvalidParameterError
from loraplex.platform.engine.limits import EngineLimits
from loraplex.platform.engine.lora_runtime import LoRARuntime
from loraplex.platform.engine.sampling_params import SamplingParams
from loraplex.platform.engine.sequence import Request, Sequence
from loraplex.platform.engine.structured import GrammarCompiler
from loraplex.platform.engine.validation import (
    check_request_limits,
    check_scheduling_params,
    prompt_token_ids,
)
from loraplex.storage.kv.block_manager import KVBlockManager

_SEED_MODULUS = 1 << 64  # torch.Generator.manual_seed takes any 64-bit pattern


class RequestFactory:
    """Makes the engine's requests and sequences for one tokenizer, model and set of limits."""

    def __init__(
        self,
        tokenizer: Any,
        limits: EngineLimits,
        block_manager: KVBlockManager,
        grammars: GrammarCompiler,
        lora_runtime: LoRARuntime | None,
    ) -> None:
        self._tokenizer = tokenizer
        self._limits = limits
        self._block_manager = block_manager
        self._grammars = grammars
        self._lora_runtime = lora_runtime

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of ``prompt`` (with the model's special tokens, e.g. BOS)."""
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            # Lone surrogates ("\ud800") are valid JSON but no text: refuse them here,
            # before the tokenizer (Rust) fails on them in a less readable way.
            raise InvalidParameterError(
                f"prompt is not valid Unicode text: {exc.reason} at position {exc.start}", param="prompt"
            ) from None
        return list(self._tokenizer.encode(prompt, add_special_tokens=True))

    def make(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None,
        priority: int,
        tenant_id: str | None,
        tenant_weight: float,
        timeout_s: float | None,
    ) -> Request:
        """A validated request with its first sequence (see ``LLMEngine.add_request`` for what
        raises); nothing is queued or held when it raises."""
        if not isinstance(params, SamplingParams):
            raise InvalidParameterError(
                f"params must be SamplingParams, got {type(params).__name__}", param="sampling_params"
            )
        check_scheduling_params(tenant_weight, timeout_s)
        text, token_ids = prompt_token_ids(prompt, self.tokenize, self._limits.vocab_size)
        check_request_limits(len(token_ids), params, self._limits, self._block_manager)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self._grammars.compile(params.structured_outputs)  # the server compiled it: a hit
        adapter = None
        if lora_request is not None:
            if self._lora_runtime is None:
                raise AdapterUnavailableError(
                    "lora_request given but the engine was built without enable_lora=True", param="model"
                )
            adapter = self._lora_runtime.resolve(lora_request)
        req = Request(
            request_id,
            text,
            token_ids,
            params,
            priority=priority,
            lora=lora_request,
            adapter=adapter,
            tenant_id=tenant_id,
            tenant_weight=tenant_weight,
            grammar=grammar,
        )
        req.seqs.append(self.new_sequence(req, 0, list(token_ids)))
        return req

    def new_sequence(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        """Sequence ``index`` of ``req`` (0: the first; others: siblings forked from it)."""
        gen = None
        if req.params.seed is not None:
            # Each completion of a seeded request gets its own stream: seed for the
            # first, derived seeds for forked siblings (wrapped into 64 bits).
            gen = torch.Generator().manual_seed((req.params.seed + 1_000_003 * index) % _SEED_MODULUS)
        detok = IncrementalDetokenizer(
            self._tokenizer,
            req.prompt_token_ids,
            skip_special_tokens=req.params.skip_special_tokens,
            stop=req.params.stop_strings,
            include_stop_str_in_output=req.params.include_stop_str_in_output,
        )
        seq = Sequence(request=req, index=index, token_ids=token_ids, generator=gen, detokenizer=detok)
        if req.grammar is not None:
            # Siblings fork before the first token is sampled: each starts from the start state.
            seq.grammar = req.grammar.new_state()
        return seq
