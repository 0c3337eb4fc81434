"""Speculative decoding: prompt-lookup (n-gram) drafts verified in one forward, KV rolled back.

``speculative_config`` is vLLM's: ``{"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_min": 1, "prompt_lookup_max": 4}``, or a draft model (``draft_model.py``).

Per decode step of a running sequence the proposer looks for the last ``n`` tokens
(``prompt_lookup_max`` down to ``prompt_lookup_min``) earlier in the sequence and proposes
the ``k`` tokens that followed that match. The drafts are appended to the sequence and the
step schedules ``1 + k`` tokens for it: the same path as a prefill chunk, mixed with the other
sequences' decodes and prefills, with the request's own adapter. Every one of those positions
returns logits; ``verify`` keeps the longest run of drafts the target agrees with plus one
token of the target's own, so each step emits 1 to ``k + 1`` tokens:

- temperature 0: a draft is kept while it equals the target's argmax (exactly the greedy tokens);
- temperature > 0: rejection sampling (Leviathan et al., 2023) with the draft as a point mass
  ``q``: a draft ``d`` is kept with probability ``p(d)``; on the first rejection the token is drawn
  from ``p`` without ``d``, renormalised (``(p - q)+``); after all ``k`` a bonus token from ``p``.
  The emitted tokens are distributed exactly as the target's samples.

KV: the drafts' slots are allocated like any tokens; after verification the sequence's
``num_computed_tokens`` drops to the accepted length and whole blocks past it go back to the
pool (``KVBlockManager.truncate``). Blocks are made findable for the prefix cache only after
verification, up to the accepted tokens: a rejected token is never cached.

Policy (``spec_policy``): each step, each speculating sequence gets as many drafts (up to ``k``)
as pay for their rows: its measured acceptance per draft position against the step's measured
cost per row, so a large batch of a compute-bound CPU speculates only where drafts are nearly
always accepted, and a single stream nearly always. ``disable_by_batch_size`` (vLLM's knob)
still turns speculation off past that many running sequences when set. Requests with
penalties, logprobs, ``n > 1``, pending ``min_tokens`` or structured outputs
(``structured_outputs``: the grammar masks are computed for one position per step) decode
normally, token by token, beside speculating ones.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from loraplex.platform.engine.sampler import filter_logits, greedy_tokens
from loraplex.platform.engine.sampling_params import SamplingParams
from loraplex.platform.engine.scheduler_output import SchedulerOutput
from loraplex.platform.engine.sequence import Sequence
from loraplex.platform.engine.spec_policy import PositionCounts, StepCost, allot_drafts

logger = logging.getLogger(__name__)

METHODS = ("ngram", "draft_model")
DRAFT_POLICIES = ("measured", "always")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` (the fields loraplex serves)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    """``draft_model``: the draft, a local HF folder or GGUF file with the target's vocabulary."""
    quantization: str = "auto"
    """``draft_model``: how the draft's weights are kept (the engine's ``quantization`` values)."""
    num_draft_kv_blocks: int | None = None
    """``draft_model``: blocks of the draft's own paged KV (None: room for ``disable_by_batch_size``,
    else ``max_num_seqs``, sequences of ``max_model_len``, at most ``DRAFT_KV_BYTES``)."""
    disable_by_batch_size: int | None = None
    """Speculate only while at most this many sequences run (None: the cost rule alone decides)."""
    min_acceptance: float = 0.2
    """A draft position whose estimated acceptance is under this is never proposed."""
    warmup: int = 4
    """Drafts the engine-wide acceptance rate counts for in a request's own estimate (a new
    request starts from what the others did; after ``warmup`` drafts its own weigh as much)."""
    backoff_steps: int = 32
    """A request given no drafts for this many decode steps is given one (a probe)."""
    draft_policy: str = "measured"
    """``measured``: drafts per sequence and step by the cost rule (``spec_policy``); ``always``:
    every eligible decode gets ``num_speculative_tokens`` drafts each step (vLLM's behaviour)."""
    cost_fixed_rows: float = 16.0
    """Before the engine has timed steps of different sizes: the rows whose compute costs as much
    as a step's fixed part (weights read once, the Python around the forward). Measured on a
    2-core CPU with the bundled model: ~15."""

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From the dict (or JSON text) vLLM takes; ValueError naming what is wrong."""
        if isinstance(value, SpeculativeConfig):
            return value
        data = json.loads(value) if isinstance(value, str) else dict(value)
        if not isinstance(data, dict):
            raise ValueError("speculative_config must be a JSON object")
        # vLLM's reading: a draft model named without a method is the draft_model method.
        method = data.pop("method", "draft_model" if data.get("model") else "ngram")
        if method == "draft_model":
            # A draft model that sits steps out must catch its KV up when it comes back (a
            # prefill of what the target emitted meanwhile), a cost the measured rule does not
            # see: by default it drafts every step, up to 4 running sequences.
            data.setdefault("draft_policy", "always")
            data.setdefault("disable_by_batch_size", 4)
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {method!r}")
        known = {f for f in cls.__dataclass_fields__ if f != "method"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {sorted(unknown)}; known: {sorted(known)}")
        cfg = cls(method=method, **data)
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(cfg, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {v!r}")
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError("speculative_config prompt_lookup_min must be <= prompt_lookup_max")
        if cfg.disable_by_batch_size is not None and cfg.disable_by_batch_size < 1:
            raise ValueError("speculative_config disable_by_batch_size must be >= 1 (or null)")
        if method == "draft_model":
            if not isinstance(cfg.model, str) or not cfg.model:
                raise ValueError(
                    "speculative_config method 'draft_model' needs 'model': the draft's folder or .gguf file"
                )
        elif cfg.model is not None:
            raise ValueError(f"speculative_config 'model' is for method 'draft_model', not {method!r}")
        if cfg.draft_policy not in DRAFT_POLICIES:
            raise ValueError(
                f"speculative_config draft_policy must be one of {DRAFT_POLICIES}, got {cfg.draft_policy!r}"
            )
        blocks = cfg.num_draft_kv_blocks
        if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1):
            raise ValueError(f"speculative_config num_draft_kv_blocks must be an integer >= 1: {blocks!r}")
        return cfg


class Proposer(Protocol):
    """Proposes drafts for the sequences that speculate this step (n-gram lookup, a draft model)."""

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """Up to ``k`` draft tokens for each ``(sequence, k)``, by ``seq_id``; none for some is fine."""
        ...

    def forget(self, seq_id: int) -> None:
        """``seq_id`` ended: drop what was kept for it."""
        ...

    @property
    def seconds_per_draft(self) -> float:
        """What proposing one more draft token costs (0: next to nothing, as a lookup)."""
        ...


def ngram_propose(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: the ``k`` tokens that followed the latest earlier occurrence of the longest
    suffix (``n_max`` down to ``n_min`` tokens) of ``tokens``; [] when none occurs."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n :]
        # The latest match wins: recent text is the likeliest to be copied again.
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
                break
    return []


class NgramProposer:
    """Prompt lookup (``ngram_propose``) for each sequence; keeps nothing between steps."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        cfg = self.config
        drafts = {
            seq.seq_id: ngram_propose(seq.token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            for seq, k in wants
        }
        return {seq_id: d for seq_id, d in drafts.items() if d}

    def forget(self, seq_id: int) -> None:
        pass

    @property
    def seconds_per_draft(self) -> float:
        return 0.0


@dataclass
class SpecCounters:
    """Proposed / accepted draft tokens (vLLM's ``spec_decode`` counters), engine-wide."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def snapshot(self) -> SpecCounters:
        """A copy (for ``EngineStats``: other threads read it)."""
        return SpecCounters(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos)
        )

    def count(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.append(0)
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1


@dataclass
class _SeqSpec:
    counts: PositionCounts = field(default_factory=PositionCounts)
    idle: int = 0
    """Decode steps since it was last given drafts."""


class Speculator:
    """Plans each step's drafts for the scheduler and verifies them for the output processor."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer: Proposer = proposer if proposer is not None else NgramProposer(config)
        self.counters = SpecCounters()
        self.positions = PositionCounts()
        """Engine-wide acceptance per draft position (every request's estimate starts from it)."""
        self.cost = StepCost(config.cost_fixed_rows)
        self._proposing_seconds = 0.0
        """The proposer's time in this step (kept out of the step's time in the cost fit)."""
        self._seqs: dict[int, _SeqSpec] = {}
        self._planned: dict[int, list[int]] = {}

    # -- proposing (the scheduler, at the start of each step's planning) -------------------
    def plan(self, running: list[Sequence], budget: int, max_model_len: int) -> None:
        """Allot this step's drafts (``spec_policy``) and propose them for every sequence that got
        some, in one go (a draft model runs its forwards for all of them together); ``propose``
        hands them out."""
        self._planned.clear()
        self._proposing_seconds = 0.0
        cfg = self.config
        if cfg.disable_by_batch_size is not None and len(running) > cfg.disable_by_batch_size:
            return
        candidates: list[tuple[int, list[float]]] = []
        forced: dict[int, int] = {}
        decodes: dict[int, Sequence] = {}
        for seq in running:
            if seq.num_uncomputed_tokens != 1:
                continue
            decodes[seq.seq_id] = seq
            k = self._max_drafts(seq, budget, max_model_len)
            if k <= 0:
                continue
            state = self._seqs.setdefault(seq.seq_id, _SeqSpec())
            if cfg.draft_policy == "always":
                forced[seq.seq_id] = k
                continue
            if state.idle >= cfg.backoff_steps:
                forced[seq.seq_id] = 1  # its estimate may be stale: one draft to measure again
                continue
            probs = []
            for j in range(k):
                p = state.counts.rate(j, self.positions.rate(j, 0.5, cfg.warmup), cfg.warmup)
                if p < cfg.min_acceptance:
                    break
                probs.append(p)
            candidates.append((seq.seq_id, probs))
        row_seconds = self.cost.row_seconds()
        draft_rows = self.proposer.seconds_per_draft / row_seconds if row_seconds else 0.0
        given = allot_drafts(candidates, len(decodes), self.cost.fixed_rows(), draft_rows)
        given.update(forced)
        for seq_id in decodes:
            state = self._seqs.setdefault(seq_id, _SeqSpec())
            state.idle = 0 if seq_id in given else state.idle + 1
        wants = [(decodes[seq_id], k) for seq_id, k in given.items()]
        if not wants:
            return
        started = time.perf_counter()
        try:
            self._planned = self.proposer.propose(wants)
            self._proposing_seconds = time.perf_counter() - started
        except Exception:  # drafts are an optimisation: their failure must not fail the step
            logger.exception("speculative proposer failed; %d sequences decode without drafts", len(wants))
            for seq, _ in wants:
                self.proposer.forget(seq.seq_id)  # what it kept for them may be half written

    def propose(self, seq: Sequence, budget: int) -> list[int]:
        """``seq``'s planned drafts, as many as ``budget`` tokens leave room for (with its own)."""
        drafts = self._planned.pop(seq.seq_id, [])
        return drafts[: max(0, budget - 1)]

    def _max_drafts(self, seq: Sequence, budget: int, max_model_len: int) -> int:
        """The most drafts ``seq`` may take this step (0: it decodes normally)."""
        if not eligible(seq.params, seq):
            return 0
        p = seq.params
        k = min(self.config.num_speculative_tokens, budget - 1, max_model_len - seq.num_tokens - 1)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - seq.num_output_tokens - 1)
        return max(0, k)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """A step's wall time, for the cost fit: decode steps only (a prefill chunk's rows cost
        what a matrix product's do, not a decode's)."""
        if out.scheduled and all(item.num_new_tokens == 1 + item.num_draft for item in out.scheduled):
            self.cost.observe(out.num_batched_tokens, seconds - self._proposing_seconds)

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Count one verification (engine-wide, per request, per draft position)."""
        self.counters.count(proposed, accepted)
        self.positions.count(proposed, accepted)
        req = seq.request
        req.spec_proposed += proposed
        req.spec_accepted += accepted
        self._seqs.setdefault(seq.seq_id, _SeqSpec()).counts.count(proposed, accepted)

    def forget(self, seq: Sequence) -> None:
        self._seqs.pop(seq.seq_id, None)
        self._planned.pop(seq.seq_id, None)
        self.proposer.forget(seq.seq_id)


def eligible(params: SamplingParams, seq: Sequence) -> bool:
    """Whether ``verify`` reproduces the sampler for this request: no penalties (they change
    with every token), no logprobs, one completion, ``min_tokens`` reached, and no output grammar
    (structured outputs decode one token at a time for now: their masks are per position)."""
    return (
        seq.grammar is None
        and not params.needs_penalties
        and params.logprobs is None
        and params.n == 1
        and seq.num_output_tokens >= params.min_tokens
    )


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampler's distribution for each row of ``logits`` [rows, vocab] under ``params``
    (temperature, then top-k / top-p / min-p), float32 on the CPU."""
    rows, vocab = logits.shape
    sub = logits.float()
    sub = (sub - sub.amax(dim=-1, keepdim=True)) / max(params.temperature, 1e-30)
    top_k = min(params.top_k, vocab)
    if top_k > 0 or params.top_p < 1 or params.min_p > 0:
        sub = filter_logits(
            sub,
            torch.full((rows,), top_k, dtype=torch.long),
            torch.full((rows,), params.top_p, dtype=sub.dtype),
            torch.full((rows,), params.min_p, dtype=sub.dtype),
        )
    return sub.softmax(dim=-1).cpu()


def verify(
    logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """The tokens to emit for ``drafts`` scored by ``logits`` [len(drafts) + 1, vocab], and how
    many drafts were accepted (see the module docstring)."""
    k = len(drafts)
    if params.greedy:
        target = greedy_tokens(logits).tolist()
        a = 0
        while a < k and drafts[a] == target[a]:
            a += 1
        return [*drafts[:a], int(target[a])], a
    probs = target_probs(logits, params)
    uniforms = torch.rand(k, generator=generator).tolist() if k else []
    out: list[int] = []
    for j, d in enumerate(drafts):
        if uniforms[j] < float(probs[j, d]):
            out.append(d)
            continue
        residual = probs[j].clone()
        residual[d] = 0.0
        out.append(int(torch.multinomial(residual, 1, generator=generator)[0]))
        return out, j
    out.append(int(torch.multinomial(probs[k], 1, generator=generator)[0]))
    return out, k
