"""An adapter's pages: how many it needs per group, which ones it holds, how compaction moves them.

A page holds ``page_rank`` (P) rank rows of one projection group (``spec.GROUPS``: qkv, o,
gate_up, down) in every layer, so an adapter whose modules in a group have rank r (the
largest of them) needs ``ceil(r / P)`` pages there, page i holding its rows ``[iP, (i+1)P)``;
groups it does not target cost nothing. Its ``PageTable`` names those pages; a compaction
of the pool (``page_pool.py``) hands back ``Remaps`` that every page table must follow.
"""

from __future__ import annotations

from loraplex.adapters.peft_weights import AdapterWeights
from loraplex.adapters.spec import GROUPS, GroupName

PageTable = dict[GroupName, list[int]]
"""An adapter's pages per group it targets (page ids index that group's pool)."""

Remaps = dict[GroupName, dict[int, int]]
"""Pages a compaction moved, per group: ``{old page: new page}`` (page tables must follow)."""


def pages_needed(weights: AdapterWeights, page_rank: int) -> dict[GroupName, int]:
    """Pages an adapter needs per group: its largest rank in the group, in pages (rounded up)."""
    rank: dict[GroupName, int] = {}
    module_group = {m: g for g, modules in GROUPS.items() for m in modules}
    for (_layer, module), w in weights.modules.items():
        group = module_group[module]
        rank[group] = max(rank.get(group, 0), int(w.lora_a.shape[0]))
    return {g: -(-r // page_rank) for g, r in rank.items() if r > 0}
