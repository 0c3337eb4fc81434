"""A step's allowed-token masks: computed on a worker thread while the forward runs, then
applied to the logits rows of the sequences under a grammar.

The engine calls ``start`` with the step's grammar states before the forward, and the
output processor ``StepMasks.apply`` after it: llguidance drops the GIL while it computes a
mask, and the forward spends its time in kernels that drop it too, so the two overlap. A row
whose mask admits no token means its grammar failed; ``apply`` reports those rows and the
caller fails just their requests.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from loraplex.platform.engine.structured.state import GrammarState


@dataclass
class MaskTimes:
    """Cumulative mask cost (any thread reads; the engine thread and the worker write)."""

    masks: int = 0
    """Masks computed (one per sequence per step under a grammar)."""
    compute_s: float = 0.0
    """Seconds the worker spent computing them (overlapped with the forward)."""
    wait_s: float = 0.0
    """Seconds the engine thread waited for them after the forward (not overlapped)."""
    apply_s: float = 0.0
    """Seconds applying them to the logits (engine thread)."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


@dataclass
class StepMasks:
    """The masks of one step: ``rows[scheduled index]`` is that sequence's row of ``bitmask``."""

    bitmask: torch.Tensor
    rows: dict[int, int]
    future: Future[None]
    times: MaskTimes

    def apply(
        self, logits: torch.Tensor, scheduled_of_row: list[int], plain_greedy: list[bool]
    ) -> tuple[torch.Tensor, list[int]]:
        """Set the disallowed tokens of every grammar row of ``logits`` to -inf, in place (it is
        this step's own tensor); the rows whose mask admits nothing (a failed grammar).

        ``scheduled_of_row[r]`` is the scheduled index of logits row ``r`` (forked siblings share
        their parent's); ``plain_greedy[r]`` says the row takes the argmax of these very logits
        (greedy, no penalties): when the grammar allows that token the row is left alone, which
        gives the same token for a fraction of the cost (writing -inf over a 49k vocabulary is
        ~0.4 ms a row on a loaded core, testing one bit is nothing).
        """
        started = time.perf_counter()
        self.future.result()
        waited = time.perf_counter() - started
        words_all = self.bitmask.numpy()
        vocab = logits.shape[-1]
        full: list[tuple[int, int]] = []
        empty: list[int] = []
        # numpy, not torch: on a loaded CPU each small torch op pays its thread pool's hand-off
        # (a 49k-row masked_fill_ measured 5 ms; numpy's copyto 0.4 ms, single-threaded).
        values = logits.detach().numpy() if logits.device.type == "cpu" else None
        greedy_rows = [r for r, i in enumerate(scheduled_of_row) if i in self.rows and plain_greedy[r]]
        top: dict[int, int] = {}
        if greedy_rows:
            if values is not None:
                best: list[int] = values[greedy_rows].argmax(axis=-1).tolist()
            else:
                best = logits[greedy_rows].argmax(dim=-1).tolist()
            top = dict(zip(greedy_rows, best, strict=True))
        for r, i in enumerate(scheduled_of_row):
            m = self.rows.get(i)
            if m is None:
                continue
            token = top.get(r)
            if (
                token is not None
                and token < words_all.shape[1] * 32
                and (int(words_all[m, token >> 5]) >> (token & 31)) & 1
            ):
                continue  # the grammar allows the argmax: the row's answer is unchanged
            full.append((r, m))
        if full:
            rows = [r for r, _ in full]
            words = words_all[[m for _, m in full]]
            allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little").view(bool)
            if allowed.shape[1] < vocab:  # the model's vocabulary is padded past the tokenizer's
                allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
            allowed = allowed[:, :vocab]
            if values is not None:
                for j, r in enumerate(rows):
                    # A grammar usually allows few tokens: keep those, fill the row (a plain
                    # fill runs at memory speed, a masked copy at a fraction of it).
                    keep = np.flatnonzero(allowed[j])
                    if len(keep) * 4 < vocab:
                        kept = values[r, keep]
                        values[r].fill(-np.inf)
                        values[r, keep] = kept
                    else:
                        np.copyto(values[r], -np.inf, where=~allowed[j])
            else:
                banned = torch.from_numpy(~allowed).to(logits.device)
                with torch.inference_mode():
                    for j, r in enumerate(rows):
                        logits[r].masked_fill_(banned[j], float("-inf"))
            counts = [bool(allowed[j].any()) for j in range(len(rows))]
            empty = [r for r, any_allowed in zip(rows, counts, strict=True) if not any_allowed]
        with self.times.lock:
            self.times.wait_s += waited
            self.times.apply_s += time.perf_counter() - started - waited
        return logits, empty


class GrammarMasker:
    """Runs the mask computations of each step on one worker thread."""

    def __init__(self, mask_words: int) -> None:
        self.mask_words = mask_words
        self.times = MaskTimes()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-grammar")

    def start(self, states: dict[int, GrammarState]) -> StepMasks | None:
        """Begin computing the masks of ``states`` (scheduled index -> state); None when empty.
        The states must not change until ``StepMasks.apply`` returned."""
        if not states:
            return None
        bitmask = torch.zeros(len(states), self.mask_words, dtype=torch.int32)
        rows = {i: row for row, i in enumerate(states)}
        items = [(row, states[i]) for i, row in rows.items()]

        def compute() -> None:
            started = time.perf_counter()
            for row, state in items:
                state.fill_mask(bitmask, row)
            with self.times.lock:
                self.times.masks += len(items)
                self.times.compute_s += time.perf_counter() - started

        return StepMasks(bitmask, rows, self._pool.submit(compute), self.times)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
