"""Where the group pools' tensors lie in the arena: the packing, the views, the check.

Every group's per-layer A and B tensors are laid out in the arena's chunks (``page_arena.py``:
in an engine, a block range of the K cache and one of the V cache per layer), each at an
aligned byte offset. ``place`` packs them so the fullest chunk is as empty as can be (at
most 8 tensors: every split into two chunks is tried; more chunks: largest first into the
emptiest); the arena needs as many blocks as that chunk. ``views`` carves a group's tensors
out of the chunks at their places; ``check_placement`` checks they lie there, apart.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from loraplex.adapters.group_pool import GroupPool
from loraplex.adapters.page_arena import ALIGN, PageArena
from loraplex.adapters.spec import GroupName


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to the arena's alignment."""
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class Placement:
    """Where each group's A (0) and B (1) tensor sit in every layer: (chunk, byte offset)."""

    num_blocks: int = 0
    spots: dict[tuple[GroupName, int], tuple[int, int]] = field(default_factory=dict)


def place(
    capacities: Iterable[tuple[GroupName, int]],
    groups: Mapping[GroupName, GroupPool],
    num_chunks: int,
    block_nbytes: int,
) -> Placement:
    """Every group's A and B per layer at ``capacities`` pages (``(group, pages)`` pairs, none
    of them 0) in ``num_chunks`` chunks, the fullest chunk as empty as can be."""
    items = []
    for group, capacity in capacities:
        pool = groups[group]
        items.append((align(pool.a_nbytes * capacity), group, 0))
        items.append((align(pool.b_nbytes * capacity), group, 1))
    items.sort(reverse=True)
    bins: list[list[tuple[int, GroupName, int]]] = [[] for _ in range(num_chunks)]
    if num_chunks == 2 and items:
        # The first item goes to chunk 0 (the two chunks are alike); bit i: item i + 1.
        best = min(
            range(1 << (len(items) - 1)),
            key=lambda mask: max(
                sum(n for i, (n, _, _) in enumerate(items) if i and mask >> (i - 1) & 1),
                sum(n for i, (n, _, _) in enumerate(items) if not i or not mask >> (i - 1) & 1),
            ),
        )
        for i, item in enumerate(items):
            bins[1 if i and best >> (i - 1) & 1 else 0].append(item)
    else:
        for item in items:
            min(bins, key=lambda b: sum(n for n, _, _ in b)).append(item)
    spots: dict[tuple[GroupName, int], tuple[int, int]] = {}
    for chunk, placed in enumerate(bins):
        offset = 0
        for nbytes, group, which in placed:
            spots[(group, which)] = (chunk, offset)
            offset += nbytes
    fullest = max(sum(n for n, _, _ in b) for b in bins)
    return Placement(-(-fullest // block_nbytes), spots)


def views(
    arena: PageArena, pool: GroupPool, capacity: int, placement: Placement
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``pool``'s A and B tensors of ``capacity`` pages in every layer, as views of the arena's
    chunks where ``placement`` puts them (no pages: empty tensors of their own)."""
    if capacity == 0:
        return [pool.allocate_tensors(0, pool.device) for _ in range(pool.num_layers)]
    shapes = pool.shapes(capacity)
    result = []
    for layer in range(pool.num_layers):
        chunks = arena.chunks(layer)
        pair = []
        for which, shape in enumerate(shapes):
            chunk, offset = placement.spots[(pool.group, which)]
            nbytes = math.prod(shape) * torch.empty((), dtype=pool.dtype).element_size()
            pair.append(chunks[chunk][offset : offset + nbytes].view(pool.dtype).view(shape))
        result.append((pair[0], pair[1]))
    return result


def check_placement(
    arena: PageArena, placement: Placement, groups: Mapping[GroupName, GroupPool], num_layers: int
) -> list[str]:
    """Errors: the groups' tensors not inside the arena's chunks, not in their places, or overlapping."""
    if placement.num_blocks > arena.num_blocks:
        return [f"the layout needs {placement.num_blocks} blocks, the arena {arena.num_blocks}"]
    errors: list[str] = []
    for layer in range(num_layers):
        chunks = arena.chunks(layer)
        spans: list[tuple[int, int, str]] = []
        for group, pool in groups.items():
            if pool.capacity == 0:
                continue
            for which, tensor in enumerate(pool.layers[layer]):
                chunk, offset = placement.spots[(group, which)]
                base = chunks[chunk].data_ptr()
                start = tensor.data_ptr()
                if start != base + offset or offset + tensor.nbytes > chunks[chunk].nbytes:
                    errors.append(f"layer {layer} {group}[{which}] is not where the layout puts it")
                spans.append((start, start + tensor.nbytes, f"{group}[{which}]"))
        spans.sort()
        for (_, end, name), (start, _, other) in itertools.pairwise(spans):
            if start < end:
                errors.append(f"layer {layer}: {name} and {other} overlap")
    return errors
