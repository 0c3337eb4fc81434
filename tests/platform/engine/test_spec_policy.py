"""The drafts' policy: a draft position is proposed when its measured acceptance pays for its row
at the step's measured cost per row; the cost is fitted from decode steps' wall times."""

from __future__ import annotations

import math

from loraplex.platform.engine.spec_policy import PositionCounts, StepCost, allot_drafts


def test_position_counts_and_the_prior() -> None:
    counts = PositionCounts()
    counts.count(3, 1)  # draft 0 accepted, 1 and 2 rejected
    counts.count(2, 2)
    assert counts.proposed == [2, 2, 1] and counts.accepted == [2, 1, 0]
    assert counts.rate(0, prior=0.5, weight=2) == (2 + 1) / (2 + 2)
    assert counts.rate(5, prior=0.3, weight=4) == 0.3  # never proposed there: the prior alone


def test_a_single_stream_takes_every_likely_draft() -> None:
    """One decode, a fixed cost of 16 rows: a draft pays above 1/17 of a token."""
    given = allot_drafts([(7, [0.9, 0.5, 0.2, 0.05])], num_rows=1, fixed_rows=16.0)
    assert given == {7: 3}


def test_a_large_batch_takes_only_the_drafts_nearly_always_accepted() -> None:
    """16 decodes with the fixed cost of 16 rows: the step's 16 tokens cost 32 rows, so a draft
    needs p > 0.5 x MARGIN (rising as drafts are taken); one copying sequence gets its first
    three drafts (its fourth, 0.6, is under 0.61), one whose drafts are accepted a third of the
    time gets none."""
    candidates = [(1, [0.95, 0.9, 0.85, 0.6]), (2, [0.33, 0.2])] + [(i, []) for i in range(3, 17)]
    given = allot_drafts(candidates, num_rows=16, fixed_rows=16.0)
    assert given == {1: 3}
    assert allot_drafts(candidates, num_rows=16, fixed_rows=0.0) == {}  # all compute: nothing pays


def test_a_costly_draft_must_promise_more() -> None:
    """A draft model's forwards cost rows of their own: the same drafts at one stream, free to
    propose (prompt lookup), or costing 1, 3 or 12 rows each."""
    candidates = [(1, [0.9, 0.6, 0.3])]
    assert allot_drafts(candidates, num_rows=1, fixed_rows=8.0) == {1: 3}
    assert allot_drafts(candidates, num_rows=1, fixed_rows=8.0, draft_rows=1.0) == {1: 2}
    assert allot_drafts(candidates, num_rows=1, fixed_rows=8.0, draft_rows=3.0) == {1: 1}
    assert allot_drafts(candidates, num_rows=1, fixed_rows=8.0, draft_rows=12.0) == {}


def test_a_later_position_is_never_likelier_than_an_earlier_one() -> None:
    """Draft j needs drafts 0..j-1 accepted: an estimate that rises again is capped."""
    given = allot_drafts([(1, [0.4, 0.9])], num_rows=4, fixed_rows=4.0)
    assert given == {}  # 0.4 < 4 / 8; the 0.9 behind it is worth no more than 0.4


def test_step_cost_fit() -> None:
    cost = StepCost(prior_fixed_rows=16.0)
    for _ in range(20):
        cost.observe(16, 0.05)
    assert cost.fixed_rows() == 16.0  # every step the same size: the prior
    cost = StepCost(prior_fixed_rows=16.0)
    for rows in range(16, 48):
        cost.observe(rows, 0.035 + 0.0025 * rows)  # fixed 35 ms, 2.5 ms a row
    assert math.isclose(cost.fixed_rows(), 14.0, rel_tol=1e-6)
    flat = StepCost(prior_fixed_rows=16.0)
    for rows in range(16, 48):
        flat.observe(rows, 0.05 - 0.0001 * rows)
    assert flat.fixed_rows() == math.inf  # more rows never cost more: any draft pays
