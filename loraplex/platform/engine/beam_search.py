"""Beam search on the paged KV cache: beams fork block tables and share blocks copy-on-write.

``LLM.beam_search(prompts, BeamSearchParams(...))`` is vLLM's offline API; the search itself
is HF transformers' (``generate(num_beams=W, num_return_sequences=W, do_sample=False)``, its
default ``early_stopping=False``), which the tests compare against token for token:

- every step, each running beam's next-token log-probabilities are added to its cumulative
  score and the best ``2 * W`` (beam, token) candidates over all beams are taken;
- a candidate that ends (EOS unless ``ignore_eos``, or the length limit) becomes a finished
  hypothesis if it ranks among the first ``W`` (score ``cum_logprob / gen_len ** length_penalty``;
  the best ``W`` are kept), the best ``W`` that do not end run on;
- the search stops when no running beam can beat the worst of ``W`` finished hypotheses
  (HF's heuristic at the current length), or when every candidate ended.

KV: a beam is a ``Sequence``. A beam chosen ``k`` times continues as itself once and as
``k - 1`` forks (``Scheduler.fork``: the block table is copied, every block's reference count
goes up, the first write into a shared block copies it), so the prompt and the common prefix
of the beams sit in the pool once; a beam no candidate continues is finished at once, its
private blocks back in the free queue. Beams are scheduled like any sequence (chunked
prefill, preemption): a step of the search runs when every beam of the prompt has its
next-token logits, whatever steps of the engine that took.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraplex.adapters.request import LoRARequest
from loraplex.platform.engine.beam_rule import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    HypothesisBeam,
    candidates_per_step,
    hf_search_step,
)
from loraplex.platform.engine.sampling_params import SamplingParams
from loraplex.platform.engine.sequence import Request, SeqStatus, Sequence

if TYPE_CHECKING:  # the engine imports this module: no cycle at run time
    from loraplex.platform.engine.engine import LLMEngine


@dataclass
class _Beam:
    seq: Sequence
    cum_logprob: float
    logprobs: list[float]


@dataclass
class _Search:
    """The state of one prompt's search."""

    request: Request
    beams: list[_Beam]
    finished: list[BeamSearchSequence] = field(default_factory=list)
    improvable: bool = True
    done: bool = False
    next_index: itertools.count[int] = field(default_factory=lambda: itertools.count(1))


class BeamSearch:
    """Runs the searches of a batch of prompts to the end on an idle engine (``step`` by ``step``
    for tests that look at the pool in between; ``run`` for the whole)."""

    def __init__(
        self,
        engine: LLMEngine,
        prompts: list[str | list[int]],
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if engine.has_unfinished_requests():
            raise RuntimeError("beam search runs on an idle engine (finish or abort the other requests)")
        self.engine = engine
        self.params = params
        eos = engine.info.eos_token_ids
        self._eos = () if params.ignore_eos else tuple(eos)
        # The sequences never sample: the per-request params only carry the limits.
        sp = SamplingParams(max_tokens=params.max_tokens, ignore_eos=True, temperature=0.0)
        self.searches: list[_Search] = []
        self._pending: dict[int, torch.Tensor] = {}  # seq_id -> next-token logprobs
        self._parked: set[int] = set()  # preempted beams with their logits, out of the queue
        try:
            for prompt in prompts:
                rid = f"beam-{engine.next_request_id()}"
                req = engine.add_request(rid, prompt, sp, lora_request=lora_request)
                req.forked = True  # siblings come from the search, not from n
                self.searches.append(_Search(req, [_Beam(req.seqs[0], 0.0, [])]))
        except Exception:
            self.abort()
            raise

    @property
    def finished(self) -> bool:
        return all(s.done for s in self.searches)

    def abort(self) -> None:
        """End every search now, freeing every beam's blocks."""
        for search in self.searches:
            self._end(search)

    def run(self) -> list[BeamSearchOutput]:
        """Step until every search ended; the outputs in prompt order."""
        try:
            while not self.finished:
                self.step()
        except BaseException:
            self.abort()
            raise
        return self.outputs()

    def step(self) -> None:
        """One engine step over every beam that needs one, then a search step for every prompt
        whose beams all have their next-token logits."""
        engine = self.engine
        out = engine.scheduler.schedule()
        for seq in out.aborted:
            reason = seq.request.error.message if seq.request.error else "rejected"
            raise RuntimeError(f"beam search request {seq.request.request_id} failed: {reason}")
        if not out.is_empty:
            engine.num_steps += 1
            engine.num_batched_tokens += out.num_batched_tokens
            lora = engine.lora_runtime
            slots = lora.step_slots(out) if lora is not None else None
            logits, sample_idx = engine.runner.execute(out, slots, lora)
            engine.scheduler.update_from_output(out)
            logprobs = logits.float().log_softmax(dim=-1)
            for row, i in enumerate(sample_idx):
                self._pending[out.scheduled[i].seq.seq_id] = logprobs[row]
        advanced = False
        for search in self.searches:
            if not search.done and all(b.seq.seq_id in self._pending for b in search.beams):
                self._advance(search)
                advanced = True
        if out.is_empty and not advanced:
            self._unblock()
        engine.publish_stats()

    def _unblock(self) -> None:
        """Nothing could run: beams that wait for memory while their siblings, done with this
        search step, hold blocks. Preempt the last of those (its logits are kept; it recomputes
        its KV later), so the waiting beams get its blocks."""
        scheduler = self.engine.scheduler
        idle = [s for s in scheduler.running if s.seq_id in self._pending and s.num_uncomputed_tokens == 0]
        if not idle or not scheduler.waiting:
            raise RuntimeError("beam search made no progress: the KV pool cannot hold one beam")
        seq = idle[-1]
        scheduler.preempt(seq)
        # Parked outside the queue until its search steps: admitted again now, it would only
        # recompute logits it has, taking the blocks back from the siblings that need them.
        scheduler.waiting.remove(seq)
        self._parked.add(seq.seq_id)

    # -- one search step (HF's) ------------------------------------------------------
    def _advance(self, search: _Search) -> None:
        width = self.params.beam_width
        beams = search.beams
        rows = torch.stack([self._pending.pop(b.seq.seq_id) for b in beams])
        cum = torch.tensor([b.cum_logprob for b in beams], dtype=rows.dtype)
        acc = (rows + cum[:, None]).flatten()
        vocab = rows.shape[1]
        keep = min(candidates_per_step(width, len(self._eos)), acc.numel())
        top_scores, top_idx = torch.topk(acc, keep)
        scored = [
            (score, *divmod(flat, vocab))
            for score, flat in zip(top_scores.tolist(), top_idx.tolist(), strict=True)
        ]
        chosen = hf_search_step(
            search,
            scored,
            [HypothesisBeam(b.seq.token_ids, b.logprobs, b.seq.num_output_tokens) for b in beams],
            lambda b, tok: float(rows[b, tok]),
            self.params,
            self._eos,
            self.engine.info.max_model_len,
        )
        if chosen is None:
            self._end(search)
            return
        search.beams = self._fork(search, chosen)

    def _fork(self, search: _Search, chosen: list[tuple[float, int, int, bool]]) -> list[_Beam]:
        """The next beams: each parent continues as itself for its first child and forks the
        rest (sharing its blocks); parents no child continues are finished (blocks freed)."""
        engine = self.engine
        parents = search.beams
        children: dict[int, list[tuple[float, int]]] = {}
        for score, b, tok, _ in chosen:
            children.setdefault(b, []).append((score, tok))
        new: list[tuple[_Beam, int]] = []
        for b, beam in enumerate(parents):
            kids = children.get(b)
            if not kids:
                self._parked.discard(beam.seq.seq_id)
                engine.scheduler.finish(beam.seq, SeqStatus.FINISHED_ABORTED)
                continue
            parent_lp = list(beam.logprobs)
            rows = self._row_logprobs(beam, kids)
            # Forks first, from the parent as it stands (before its own new token).
            for (score, tok), lp in list(zip(kids, rows, strict=True))[1:]:
                child = engine.factory.new_sequence(
                    search.request, next(search.next_index), list(beam.seq.token_ids)
                )
                search.request.seqs.append(child)
                if beam.seq.status is SeqStatus.RUNNING:
                    engine.scheduler.fork(beam.seq, child)
                else:  # preempted after its logits came: it recomputes, so does the child
                    engine.scheduler.add(child)
                child.token_ids.append(tok)
                new.append((_Beam(child, score, [*parent_lp, lp]), len(new)))
            score, tok = kids[0]
            beam.seq.token_ids.append(tok)
            if beam.seq.seq_id in self._parked:
                self._parked.discard(beam.seq.seq_id)
                engine.scheduler.add(beam.seq)
            new.append((_Beam(beam.seq, score, [*parent_lp, rows[0]]), len(new)))
        # Best first, as HF orders its running beams.
        new.sort(key=lambda item: (-item[0].cum_logprob, item[1]))
        search.request.seqs = [s for s in search.request.seqs if not s.status.finished]
        return [beam for beam, _ in new]

    def _row_logprobs(self, beam: _Beam, kids: list[tuple[float, int]]) -> list[float]:
        return [score - beam.cum_logprob for score, _ in kids]

    def _end(self, search: _Search) -> None:
        if search.done:
            return
        search.done = True
        for beam in search.beams:
            self._pending.pop(beam.seq.seq_id, None)
            self._parked.discard(beam.seq.seq_id)
        req = search.request
        self.engine.scheduler.abort(req.seqs)
        self.engine.book.retire(req)

    # -- results ---------------------------------------------------------------------
    def outputs(self) -> list[BeamSearchOutput]:
        tok = self.engine.tokenizer
        outs = []
        for search in self.searches:
            n_prompt = len(search.request.prompt_token_ids)
            for seq in search.finished:
                gen = seq.tokens[n_prompt:]
                if seq.finish_reason == "stop" and gen and gen[-1] in self._eos:
                    gen = gen[:-1]  # vLLM leaves the EOS out of the text
                seq.text = str(tok.decode(gen, skip_special_tokens=True))
            outs.append(BeamSearchOutput(list(search.finished)))
        return outs
