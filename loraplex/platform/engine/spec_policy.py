"""How many drafts each speculating sequence gets this step: measured acceptance against
measured step cost.

A draft at position ``j`` of a sequence is worth its row when the chance that it is accepted
(``p_j``: the first ``j`` drafts all accepted) buys more tokens than the row costs. With a step
of ``T = fixed + per_row * rows`` seconds producing ``N`` tokens, one more row pays when
``p_j > per_row * N / T``. On a small batch the fixed part (reading every weight once, the
Python around the forward) dominates and nearly any draft pays; on a large batch of a
compute-bound CPU the step is mostly rows, and only drafts accepted most of the time do. The
rule is applied greedily over every sequence's candidate positions, likeliest first.

- ``p_j`` per sequence: its own counts (draft ``j`` proposed, accepted), shrunk towards the
  engine-wide rate for position ``j`` (a new request starts from what requests like it did).
- ``fixed`` and ``per_row``: a least-squares fit of recent decode steps' wall time (without the
  proposer's) on their rows (drafts make the rows vary); before the fit has rows of different
  sizes, ``cost_fixed_rows`` (the rows whose cost equals the fixed part) stands in.
- What a draft costs to propose (a draft model's forwards): measured seconds per draft token,
  charged in rows beside the verification row.
- A sequence that gets no drafts for ``backoff_steps`` steps is given one (a probe), so its
  estimate can recover when its text turns repetitive.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

PRIOR_WEIGHT = 4.0
"""Proposals the engine-wide rate counts for in a sequence's estimate."""
FIT_WINDOW = 256
"""Recent decode steps the cost fit reads."""
MARGIN = 1.15
"""A draft must promise this much more than its row costs: the estimates are noisy (a step's
time on a shared CPU varies by 10-30%), and a draft that only breaks even is not worth the risk."""


@dataclass
class PositionCounts:
    """Per draft position ``j`` (0-based): how often a draft stood there, and was accepted."""

    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def count(self, proposed: int, accepted: int) -> None:
        while len(self.proposed) < proposed:
            self.proposed.append(0)
            self.accepted.append(0)
        for j in range(proposed):
            self.proposed[j] += 1
            self.accepted[j] += j < accepted

    def rate(self, j: int, prior: float, weight: float) -> float:
        """The acceptance rate at position ``j``, ``prior`` counting for ``weight`` proposals."""
        n = self.proposed[j] if j < len(self.proposed) else 0
        a = self.accepted[j] if j < len(self.accepted) else 0
        return (a + prior * weight) / (n + weight)


class StepCost:
    """``seconds = fixed + per_row * rows`` fitted on recent decode steps (see module docstring)."""

    def __init__(self, prior_fixed_rows: float) -> None:
        self.prior_fixed_rows = prior_fixed_rows
        self._steps: deque[tuple[int, float]] = deque(maxlen=FIT_WINDOW)

    def observe(self, rows: int, seconds: float) -> None:
        self._steps.append((rows, seconds))

    def fixed_rows(self) -> float:
        """``fixed / per_row``: the rows whose cost equals the fixed part of a step."""
        return self._fit()[0]

    def row_seconds(self) -> float | None:
        """What one row costs, in seconds (None before any step was timed)."""
        return self._fit()[1]

    def _fit(self) -> tuple[float, float | None]:
        n = len(self._steps)
        if n == 0:
            return self.prior_fixed_rows, None
        mean_x = sum(x for x, _ in self._steps) / n
        mean_y = sum(y for _, y in self._steps) / n
        sxx = sum((x - mean_x) ** 2 for x, _ in self._steps)
        if n < 8 or sxx < n:  # rows hardly vary (variance under one row): the slope is not identified
            return self.prior_fixed_rows, mean_y / (self.prior_fixed_rows + mean_x)
        per_row = sum((x - mean_x) * (y - mean_y) for x, y in self._steps) / sxx
        if per_row <= 0:  # noise swamped the rows' cost: a step costs about the same at any size
            return float("inf"), None
        return max(0.0, mean_y - per_row * mean_x) / per_row, per_row


def allot_drafts(
    candidates: list[tuple[int, list[float]]], num_rows: int, fixed_rows: float, draft_rows: float = 0.0
) -> dict[int, int]:
    """Drafts per sequence: ``candidates`` holds each sequence's key and its ``p_j`` for the
    positions it may fill; ``num_rows`` the step's rows without drafts (one per decode). A draft
    is taken, likeliest first, while its ``p_j`` exceeds ``MARGIN`` times what its row costs in
    tokens (``per_row * N / T``, in rows: ``N / (fixed_rows + rows)``). ``draft_rows``: what
    proposing one draft costs, in rows (a draft model's forwards; ~0 for prompt lookup)."""
    ranked: list[tuple[float, int, int]] = []
    for key, probs in candidates:
        best = 1.0
        for j, p in enumerate(probs):
            best = min(best, p)  # position j needs every draft before it: never likelier than them
            ranked.append((best, j, key))
    ranked.sort(key=lambda c: (-c[0], c[1]))
    tokens = float(num_rows)  # one token per decode, whatever the drafts do
    rows = float(num_rows)
    given: dict[int, int] = {}
    for p, j, key in ranked:
        if given.get(key, 0) != j:
            continue  # an earlier position of this sequence was not taken
        cost = 1.0 + draft_rows
        if p * (fixed_rows + rows) <= MARGIN * tokens * cost:
            break
        given[key] = j + 1
        tokens += p
        rows += cost
    return given
