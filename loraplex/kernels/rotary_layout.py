"""Partial rotary embeddings (``partial_rotary_factor < 1``: Phi-4-mini) on the rotate-half kernels.

HF rotates only the first ``rotary_dim`` dimensions of each head, pairing dimension ``i`` with
``i + rotary_dim / 2``, and passes the rest through. Every rotary kernel here (C, Triton, torch)
rotates a whole head, pairing ``i`` with ``i + head_dim / 2``. Rather than a second code path in
each kernel, the q and k rows of the base weights (and of adapters' B) are stored in another
order within each head, chosen so that the whole-head rotation *is* HF's partial one:

    stored:   [ rot[:r/2] | pass[:p/2] | rot[r/2:] | pass[p/2:] ]     (r = rotary_dim, p = rest)

The first half pairs with the second, so ``rot[j]`` pairs with ``rot[j + r/2]`` as in HF, and the
pass-through dimensions get ``cos = 1, sin = 0`` in the tables (``rope_tables`` pads them so).
Attention scores are dot products of q and k over a head: the same order on both leaves them
unchanged, and v and the output projection never see it. The KV cache holds keys in this order,
which is internal (every tier, and a restart, use the same order for the same model).
"""

from __future__ import annotations


def rotary_head_order(head_dim: int, rotary_dim: int) -> list[int]:
    """For each stored position within a head, the index of the checkpoint's dimension there."""
    if rotary_dim == head_dim:
        return list(range(head_dim))
    rest = head_dim - rotary_dim
    if not 0 < rotary_dim < head_dim or rotary_dim % 2 or rest % 2:
        raise ValueError(
            f"a partial rotary dimension of {rotary_dim} in heads of {head_dim} is not supported "
            "(both parts must be even)"
        )
    half_rot, half_rest = rotary_dim // 2, rest // 2
    return [
        *range(half_rot),
        *range(rotary_dim, rotary_dim + half_rest),
        *range(half_rot, rotary_dim),
        *range(rotary_dim + half_rest, head_dim),
    ]


def rotary_row_order(num_heads: int, head_dim: int, rotary_dim: int) -> list[int]:
    """``rotary_head_order`` for each of ``num_heads`` heads laid out one after another: the rows
    of a q or k projection (``weight[order]`` stores it)."""
    head = rotary_head_order(head_dim, rotary_dim)
    return [h * head_dim + i for h in range(num_heads) for i in head]
