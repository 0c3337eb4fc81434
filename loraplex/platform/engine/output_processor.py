"""After the forward: parallel-sampling forks, sampling, stop checks, ``RequestOutput``s.

    process(out, logits, sample_idx)   every sampled row: a token, maybe a stop; the outputs
    request_output(req)                a request as the caller sees it (vLLM's shape): all of it so
                                       far, or only what is new (``RequestOutputKind.DELTA``)

Rows that cannot be sampled (NaN or +inf logits, every token banned) fail only their request.
Before ``min_tokens``, EOS and stop tokens cannot be sampled (vLLM semantics). A finished
request is handed back to the engine (``retire``), which forgets and counts it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from loraplex.platform.engine.config import RuntimeInfo
from loraplex.platform.engine.counters import TenantCounters
from loraplex.platform.engine.errors import ErrorKind, RequestError
from loraplex.platform.engine.outputs import CompletionOutput, RequestOutput
from loraplex.platform.engine.sampler import Sampler, non_finite_rows
from loraplex.platform.engine.sampling_params import RequestOutputKind
from loraplex.platform.engine.scheduler import Scheduler
from loraplex.platform.engine.scheduler_output import SchedulerOutput
from loraplex.platform.engine.sequence import Request, SeqStatus, Sequence
from loraplex.platform.engine.speculative import Speculator, verify
from loraplex.platform.engine.structured import StepMasks

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Turns one step's logits into tokens, stops and outputs (see the module docstring)."""

    def __init__(
        self,
        scheduler: Scheduler,
        sampler: Sampler,
        info: RuntimeInfo,
        usage: TenantCounters,
        new_sequence: Callable[[Request, int, list[int]], Sequence],
        fail_request: Callable[[Request, RequestError], RequestOutput],
        retire: Callable[[Request], None],
    ) -> None:
        """``new_sequence`` makes a sibling, ``fail_request`` ends a request with an error and
        ``retire`` forgets a finished one: the engine's, which owns the requests."""
        self.scheduler = scheduler
        self.sampler = sampler
        self.info = info
        self.usage = usage
        self._new_sequence = new_sequence
        self._fail_request = fail_request
        self._retire = retire
        self.speculator: Speculator | None = None
        """Verifies speculative drafts (``speculative_config``); None: off."""

    def process(
        self,
        out: SchedulerOutput,
        logits: torch.Tensor,
        sample_idx: list[int],
        masks: StepMasks | None = None,
    ) -> list[RequestOutput]:
        """Sample every row of ``logits`` (``sample_idx[row]`` is its ``out.scheduled`` index),
        fork the siblings of a request whose prompt just completed (all ``n`` first tokens come
        from the same logits), apply the grammar ``masks`` and the stops; the outputs of every
        request that progressed."""
        spec_rows: dict[int, list[int]] = {}  # scheduled index -> its rows (speculative)
        rows: list[int] = []
        seqs: list[Sequence] = []
        for row, i in enumerate(sample_idx):
            if out.scheduled[i].num_draft:
                spec_rows.setdefault(i, []).append(row)
                continue
            seq = out.scheduled[i].seq
            req = seq.request
            if req.params.n > 1 and not req.forked:
                req.forked = True
                for j in range(1, req.params.n):
                    child = self._new_sequence(req, j, list(seq.token_ids))
                    child.detokenizer = seq.detokenizer.clone()
                    req.seqs.append(child)
                    self.scheduler.fork(seq, child)
                    rows.append(row)
                    seqs.append(child)
            rows.append(row)
            seqs.append(seq)
        spec_outputs = self._verify(out, logits, spec_rows) if spec_rows else []
        if not seqs:
            return spec_outputs
        in_order = rows == list(range(logits.shape[0]))  # the usual case: one row per sequence
        row_logits = logits
        if not in_order:
            row_logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
        row_logits = self._ban_early_stops(row_logits, seqs, owned=not in_order)
        failed: list[RequestOutput] = []
        if masks is not None:
            # Rows with logprobs get the whole mask, so their logprobs are always the masked ones.
            plain_greedy = [
                s.params.greedy and not s.params.needs_penalties and s.params.logprobs is None for s in seqs
            ]
            row_logits, empty = masks.apply(row_logits, [sample_idx[r] for r in rows], plain_greedy)
            failed = self._fail_grammar(empty, seqs)
        failed += self._fail_non_finite(row_logits, seqs)
        if failed:
            keep = [r for r, s in enumerate(seqs) if not s.request.finished]
            seqs = [seqs[r] for r in keep]
            row_logits = row_logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
            if not seqs:
                return failed
        results = self.sampler.sample(
            row_logits,
            [s.params for s in seqs],
            [s.request.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            [s.generator for s in seqs],
        )
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for seq, res in zip(seqs, results, strict=True):
            if seq.status.finished:  # its request failed in this loop (a sibling's grammar)
                continue
            if seq.grammar is not None and not seq.grammar.accept_token(res.token_id):
                # The mask allowed it, so the grammar cannot refuse it: a bug, this request's only.
                msg = f"the output grammar refused the sampled token {res.token_id}"
                failed.append(self._fail_request(seq.request, RequestError(ErrorKind.ENGINE_FAILURE, msg)))
                continue
            seq.token_ids.append(res.token_id)
            self.usage.generated(seq.request.tenant_id, 1)
            if seq.params.logprobs is not None:
                seq.cumulative_logprob += res.logprob
                if res.top_logprobs is not None:
                    seq.logprobs.append(res.top_logprobs)
            stop_str = seq.detokenizer.append(res.token_id)
            status = self._stop_status(seq, res.token_id, stop_str)
            if status is not None:
                self.scheduler.finish(seq, status)
            req = seq.request
            if req.first_token_time is None:
                req.first_token_time = now
            touched[req.request_id] = req
        for req in touched.values():
            if req.finished:
                self._retire(req)
        # A FINAL_ONLY request (a non-streamed answer) gets its one output when it ends: no
        # copy of its text and tokens per step that nobody reads.
        return (
            spec_outputs
            + failed
            + [
                request_output(req)
                for req in touched.values()
                if req.finished or req.params.output_kind is not RequestOutputKind.FINAL_ONLY
            ]
        )

    def _fail_grammar(self, rows: list[int], seqs: list[Sequence]) -> list[RequestOutput]:
        """Fail the requests whose grammar admits no next token (it failed: e.g. over its
        per-step fuel); their rows would otherwise look like non-finite logits."""
        failed: dict[str, RequestOutput] = {}
        for r in rows:
            req = seqs[r].request
            if req.request_id not in failed and not req.finished:
                grammar = seqs[r].grammar
                why = (grammar.error if grammar is not None else None) or "no token can continue the output"
                msg = f"the output constraint cannot be followed further: {why}"
                failed[req.request_id] = self._fail_request(req, RequestError(ErrorKind.INVALID, msg))
        return list(failed.values())

    def _verify(
        self, out: SchedulerOutput, logits: torch.Tensor, spec_rows: dict[int, list[int]]
    ) -> list[RequestOutput]:
        """Verify each speculative sequence's drafts against its rows of ``logits``: emit the
        accepted tokens and the target's own, roll its KV back to them (``speculative.verify``)."""
        assert self.speculator is not None
        outputs: list[RequestOutput] = []
        for i, row_ids in spec_rows.items():
            item = out.scheduled[i]
            seq = item.seq
            k = item.num_draft
            drafts = seq.token_ids[-k:]
            del seq.token_ids[-k:]
            base = seq.num_tokens  # tokens before the drafts; the KV of all but the drafts is valid
            rows = logits[torch.tensor(row_ids, dtype=torch.long, device=logits.device)]
            if non_finite_rows(rows):
                msg = "the model produced non-finite logits for this request (check the adapter's weights)"
                outputs.append(self._fail_request(seq.request, RequestError(ErrorKind.ENGINE_FAILURE, msg)))
                continue
            gen = seq.generator or self.sampler.default_generator
            tokens, accepted = verify(rows, drafts, seq.params, gen)
            self.speculator.record(seq, k, accepted)
            status = None
            for tok in tokens:
                seq.token_ids.append(tok)
                self.usage.generated(seq.request.tenant_id, 1)
                status = self._stop_status(seq, tok, seq.detokenizer.append(tok))
                if status is not None:
                    break
            if status is not None:
                self.scheduler.finish(seq, status)
            else:
                self.scheduler.rollback(seq, base + accepted)
            req = seq.request
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if req.finished:
                self._retire(req)
            if req.finished or req.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(request_output(req))
        return outputs

    def _fail_non_finite(self, row_logits: torch.Tensor, seqs: list[Sequence]) -> list[RequestOutput]:
        """Fail the requests whose rows cannot be sampled: NaN or +inf (an adapter that
        overflows), or every token banned. Sampling would raise for the whole batch, so
        only the requests those rows belong to end, with an error.
        """
        bad_rows = non_finite_rows(row_logits)
        if not bad_rows:
            return []
        failed: dict[str, RequestOutput] = {}
        for r in bad_rows:
            req = seqs[r].request
            if req.request_id not in failed and not req.finished:  # (a failed grammar ended it)
                logger.warning("request %s produced non-finite logits; failing it", req.request_id)
                msg = (
                    "the model produced non-finite logits for this request, or its stop tokens ban "
                    "every token (check the adapter's weights and stop_token_ids)"
                )
                failed[req.request_id] = self._fail_request(req, RequestError(ErrorKind.ENGINE_FAILURE, msg))
        return list(failed.values())

    def _ban_early_stops(self, logits: torch.Tensor, seqs: list[Sequence], owned: bool) -> torch.Tensor:
        """Before ``min_tokens``, EOS and stop tokens cannot be sampled (vLLM semantics).

        Returns ``logits`` with those tokens at -inf: changed in place when ``owned`` (a copy
        made for this step), else in a copy (the model's output is an inference tensor)."""
        for r, seq in enumerate(seqs):
            p = seq.params
            # Under a grammar, the grammar decides where the answer ends (it may admit only EOS).
            if p.min_tokens and seq.num_output_tokens < p.min_tokens and seq.grammar is None:
                banned = list(p.stop_token_ids or [])
                if not p.ignore_eos:
                    banned.extend(self.info.eos_token_ids)
                if banned:
                    if not owned:
                        logits, owned = logits.clone(), True
                    logits[r, banned] = float("-inf")
        return logits

    def _stop_status(self, seq: Sequence, token_id: int, stop_str: str | None) -> SeqStatus | None:
        p = seq.params
        seq_len_cap = self.info.max_model_len
        if stop_str is not None:
            seq.stop_reason = stop_str
            return SeqStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= p.min_tokens:
            if p.stop_token_ids and token_id in p.stop_token_ids:
                seq.stop_reason = token_id
                return SeqStatus.FINISHED_STOPPED
            if not p.ignore_eos and token_id in self.info.eos_token_ids:
                return SeqStatus.FINISHED_STOPPED
        if seq.grammar is not None and seq.grammar.is_terminated and token_id in self.info.eos_token_ids:
            return SeqStatus.FINISHED_STOPPED  # the answer is complete: nothing may follow (ignore_eos)
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return SeqStatus.FINISHED_LENGTH
        if seq.num_tokens >= seq_len_cap:
            return SeqStatus.FINISHED_LENGTH
        return None


def request_output(req: Request) -> RequestOutput:
    """The vLLM-shaped ``RequestOutput`` of ``req`` as it stands: all of it, or with
    ``RequestOutputKind.DELTA`` what is new since its last output (and that is then sent)."""
    delta = req.params.output_kind is RequestOutputKind.DELTA
    seqs = sorted(req.seqs, key=lambda s: s.index)
    if delta:
        outs = [c for c in map(_delta_completion, seqs) if c is not None]
    else:
        outs = [
            CompletionOutput(
                index=s.index,
                text=s.detokenizer.text,
                token_ids=s.output_token_ids,
                cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
                logprobs=s.logprobs if s.params.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in seqs
        ]
    metrics = {"arrival_time": req.arrival_time}
    if req.first_token_time is not None:
        metrics["first_token_time"] = req.first_token_time
    if req.spec_proposed:  # speculative decoding: this request's drafts proposed / accepted
        metrics["spec_num_draft_tokens"] = req.spec_proposed
        metrics["spec_num_accepted_tokens"] = req.spec_accepted
    with_prompt = not (delta and req.sent_prompt)
    req.sent_prompt = True
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt if with_prompt else None,
        prompt_token_ids=req.prompt_token_ids if with_prompt else [],
        outputs=outs,
        finished=req.finished,
        num_cached_tokens=req.num_cached_tokens,
        lora_name=req.lora_name,
        metrics=metrics,
        error=req.error,
    )


def _delta_completion(seq: Sequence) -> CompletionOutput | None:
    """What ``seq`` has new since its last ``DELTA`` output (None: nothing), marked as sent.

    O(new tokens): no copy of the text or token list so far. The text holds back a possible
    stop-string prefix until the sequence finishes (``take_delta``), exactly as a stream of
    cumulative outputs held it back, so a stop string that a later token completes, which cuts
    the text there, never cuts text already sent."""
    finished = seq.status.finished
    start = seq.num_prompt_tokens + seq.num_sent_tokens
    if start >= len(seq.token_ids) and (seq.sent_finish or not finished):
        return None  # nothing new, and its end was sent (a sibling moved) or is still to come
    text = seq.detokenizer.take_delta(finished)
    token_ids = seq.token_ids[start:]
    seq.num_sent_tokens += len(token_ids)
    logprobs = None
    if seq.params.logprobs is not None:
        logprobs = seq.logprobs[seq.num_sent_logprobs :]
        seq.num_sent_logprobs = len(seq.logprobs)
    seq.sent_finish = finished
    return CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=token_ids,
        cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
        logprobs=logprobs,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )
