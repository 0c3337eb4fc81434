"""Request and sequence state.

A ``Request`` is what a user submits; it owns ``n`` ``Sequence``s (one per
completion). It starts with one sequence; when the prompt's prefill finishes and
the first token is sampled, the engine forks the others from it, sharing the
prompt's KV blocks copy-on-write. A sequence is the unit the scheduler and the
block manager see.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraplex.adapters.identity import AdapterIdentity
from loraplex.adapters.request import LoRARequest
from loraplex.platform.engine.errors import RequestError
from loraplex.platform.engine.outputs import Logprob
from loraplex.platform.engine.preemption import SwappedTail
from loraplex.platform.engine.sampling_params import SamplingParams
from loraplex.storage.kv.kv_events import NO_ORIGIN, BlockOrigin

if TYPE_CHECKING:
    from loraplex.platform.engine.detokenizer import IncrementalDetokenizer
    from loraplex.platform.engine.structured import CompiledGrammar, GrammarState

_seq_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # never run, or preempted (KV freed; cached blocks and a swapped tail come back)
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (SeqStatus.FINISHED_STOPPED, SeqStatus.FINISHED_LENGTH, SeqStatus.FINISHED_ABORTED)


@dataclass
class Sequence:
    """One completion: prompt tokens followed by generated tokens, and its KV progress."""

    request: Request
    index: int
    token_ids: list[int]
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    swapped: SwappedTail | None = None  # its partial last block, held by the tiers while preempted
    grammar: GrammarState | None = None
    """Its guided-decoding state (``params.structured_outputs``), advanced with every sampled token."""
    num_sent_tokens: int = 0
    """``RequestOutputKind.DELTA``: output tokens (and ``num_sent_logprobs`` logprob entries)
    already carried by an output; ``sent_finish``: its finish was (its text cursor is the
    detokenizer's ``take_delta``)."""
    num_sent_logprobs: int = 0
    sent_finish: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None


def tenant_cache_salt(tenant_id: str) -> bytes:
    """The prefix-cache salt of ``tenant_id`` (32 bytes): part of every key its requests cache,
    and the owner tag the tiers keep, so a deleted tenant's blocks can be purged."""
    return hashlib.sha256(b"tenant:" + tenant_id.encode()).digest()


@dataclass
class Request:
    """A submitted prompt with its parameters and identity; owns its sequences.

    Identity travels typed: ``lora`` is what the caller asked for, ``adapter`` the
    exact adapter version it resolved to (content digest: the prefix cache keys KV on
    it), ``tenant_id`` who sent it (None offline; the server sets it, clients never do).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    lora: LoRARequest | None = None
    adapter: AdapterIdentity | None = None
    tenant_id: str | None = None
    tenant_weight: float = 1.0
    """The tenant's share under fair scheduling (its weight; 1 by default)."""
    deadline: float | None = None
    """``time.monotonic()`` after which the engine ends the request (``request_timeout_s``)."""
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    first_token_time: float | None = None
    error: RequestError | None = None  # why the engine ended it, when it was not the user
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    grammar: CompiledGrammar | None = None
    """The compiled constraint of ``params.structured_outputs``; each sequence copies its start state."""
    sent_prompt: bool = False
    """``RequestOutputKind.DELTA``: an output carried the prompt already (only the first does)."""
    spec_proposed: int = 0  # draft tokens proposed for it (speculative decoding)
    spec_accepted: int = 0  # of which the target accepted

    @property
    def cache_extra_keys(self) -> tuple[bytes, bytes]:
        """What a prefix-cache key binds besides the tokens: adapter version and tenant salt.

        The adapter part is its content digest (a re-upload under the same name is another
        version); the tenant part is a digest of the tenant id, so two tenants never share
        KV. Both are empty for the base model offline. The block hash length-prefixes each
        part, so no two different pairs encode alike.
        """
        adapter = b"" if self.adapter is None else b"adapter:" + self.adapter.version.encode()
        return (adapter, self.cache_owner)

    @property
    def cache_origin(self) -> BlockOrigin:
        """The adapter its cached blocks were computed with, as KV events name it for a router."""
        if self.adapter is None:
            return NO_ORIGIN
        return BlockOrigin(self.adapter.display_name, self.adapter.adapter_id)

    @property
    def cache_owner(self) -> bytes:
        """The tenant's cache salt (b"" offline): the owner of the blocks it caches, on every tier."""
        return b"" if self.tenant_id is None else tenant_cache_salt(self.tenant_id)

    @property
    def finished(self) -> bool:
        return (
            bool(self.seqs)
            and all(s.status.finished for s in self.seqs)
            and (self.forked or self.params.n == 1)
        )

    @property
    def lora_name(self) -> str | None:
        return None if self.lora is None else self.lora.name
