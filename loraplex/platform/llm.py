"""Offline batch inference, shaped like vLLM's ``LLM`` so users can switch.

from loraplex import LLM, SamplingParams
llm = LLM()                                  # bundled SmolLM2-135M-Instruct
outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from typing import Any, TypeVar, cast

from tqdm.auto import tqdm

from loraplex.adapters.request import LoRARequest
from loraplex.platform.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from loraplex.platform.engine.config import EngineConfig
from loraplex.platform.engine.engine import LLMEngine
from loraplex.platform.engine.inputs import PromptType
from loraplex.platform.engine.outputs import RequestOutput
from loraplex.platform.engine.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")


class LLM:
    """A model with its engine; ``generate`` and ``chat`` run batches to completion."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        spec = kwargs.get("speculative_config")
        if isinstance(spec, dict):  # vLLM's LLM takes the dict; the config holds its JSON
            kwargs["speculative_config"] = json.dumps(spec)
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))

    def shutdown(self) -> None:
        """Flush the disk KV tier and stop its I/O workers (a no-op without tiers)."""
        self.llm_engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block, on every tier (see ``LLMEngine.reset_prefix_cache``)."""
        return self.llm_engine.reset_prefix_cache()

    def purge_tenant(self, tenant_id: str) -> tuple[int, int, int]:
        """Forget one tenant's cached KV on every tier (see ``LLMEngine.purge_tenant``)."""
        return self.llm_engine.purge_tenant(tenant_id)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Register an adapter ahead of use (vLLM's ``LLM.llm_engine.add_lora``)."""
        self.llm_engine.add_lora(lora_request)

    def remove_lora(self, int_id: int) -> None:
        self.llm_engine.remove_lora(int_id)

    def list_loras(self) -> list[int]:
        return self.llm_engine.list_loras()

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        priority: Seq[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        ``prompts`` are strings or token-id lists. ``sampling_params`` and
        ``lora_request`` are one for all or one per prompt. All requests are
        validated before any is queued, so a bad one leaves the engine untouched.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompt_list: list[PromptType] = [prompts]  # type: ignore[list-item,unused-ignore]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        n = len(prompt_list)
        params = self._per_prompt(sampling_params or SamplingParams(), n, "sampling_params")
        loras: list[LoRARequest | None] = self._per_prompt(lora_request, n, "lora_request")
        prios = list(priority) if priority is not None else [0] * n
        if len(prios) != n:
            raise ValueError(f"priority has {len(prios)} entries for {n} prompts")
        engine = self.llm_engine
        ids = [engine.next_request_id() for _ in range(n)]
        added: list[str] = []
        try:
            for rid, prompt, sp, lora, prio in zip(ids, prompt_list, params, loras, prios, strict=True):
                engine.add_request(rid, prompt, sp, lora_request=lora, priority=prio)
                added.append(rid)
        except Exception:
            for rid in added:
                engine.abort_request(rid)
            raise
        deltas = {
            rid for rid, sp in zip(ids, params, strict=True) if sp.output_kind is RequestOutputKind.DELTA
        }
        return self._run(ids, use_tqdm, deltas)

    def beam_search(
        self,
        prompts: Seq[PromptType | dict[str, Any]],
        params: BeamSearchParams,
        *,
        lora_request: LoRARequest | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's ``LLM.beam_search``), outputs in prompt order.

        ``prompts`` are strings, ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}``; each
        output holds the best ``beam_width`` sequences, best first (HF ``generate``'s search:
        ``engine/beam_search.py``). Beams share their KV blocks copy-on-write.
        """
        del use_tqdm  # accepted for vLLM's signature; the search reports no progress
        plain: list[str | list[int]] = []
        for p in prompts:
            if isinstance(p, dict):
                if "prompt_token_ids" in p:
                    plain.append(list(p["prompt_token_ids"]))
                elif "prompt" in p:
                    plain.append(str(p["prompt"]))
                else:
                    raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            else:
                plain.append(p)
        return BeamSearch(self.llm_engine, plain, params, lora_request).run()

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        convs = cast(
            list[list[dict[str, str]]], [messages] if messages and isinstance(messages[0], dict) else messages
        )
        tok = self.llm_engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        prompts = [
            tok.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt)
            for c in convs
        ]
        # The template already carries BOS where the model wants it.
        token_lists: list[PromptType] = [list(tok.encode(p, add_special_tokens=False)) for p in prompts]
        return self.generate(token_lists, sampling_params, lora_request=lora_request, use_tqdm=use_tqdm)

    @staticmethod
    def _per_prompt(value: T | Seq[T], n: int, name: str) -> list[T]:
        """One value for every prompt, or a list aligned with the prompts."""
        if isinstance(value, list | tuple):
            if len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
            return list(value)
        return [cast(T, value)] * n

    def _run(self, ids: list[str], use_tqdm: bool, deltas: set[str]) -> list[RequestOutput]:
        """Step until every request of ``ids`` finished; each one's whole output, in ``ids`` order
        (the outputs of the ``deltas`` requests, ``RequestOutputKind.DELTA``, merged)."""
        engine = self.llm_engine
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        partial: dict[str, RequestOutput] = {}  # the DELTA requests' outputs so far, merged
        bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", disable=not use_tqdm or len(ids) < 2)
        out_tokens = 0
        try:
            while pending:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"engine idle with {len(pending)} requests unfinished")
                for out in engine.step():
                    if out.request_id in deltas and out.request_id in pending:
                        merged = partial.setdefault(out.request_id, out)
                        if merged is not out:
                            merged.add(out, aggregate=True)  # (the engine keeps no reference to it)
                        out = merged
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        elapsed = bar.format_dict.get("elapsed") or 0.0
                        if elapsed:
                            bar.set_postfix(out_tok_s=f"{out_tokens / elapsed:.0f}")
        except BaseException:
            for rid in pending:
                engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]
