"""Content keys of full KV blocks: what the prefix cache and the lower tiers look blocks up by.

A block's KV depends on every token before it, on the model and KV layout, and on
whatever changes the model's weights or who may see the result (the adapter, the
tenant). So a full block's key hashes its parent's key (the chain back to the
start), its own token ids and the caller's extra keys; the root, the parent of the
first block, binds the model and KV-layout fingerprint::

    root     = sha256("loraplex-kv-root/1" | lp(fingerprint))
    key[0]   = sha256("loraplex-kv-block/1" | parent=root    | tokens[0:B]   | extra)
    key[i]   = sha256("loraplex-kv-block/1" | parent=key[i-1] | tokens[iB:(i+1)B] | extra)

Every variable-length part is length-prefixed (``lp``) and typed, so no two
different inputs encode alike: extra keys ``("ab", "c")`` and ``("a", "bc")``,
``b"ab"`` and ``"ab"``, or a token list and a shorter one, never share bytes:

    tokens = u32 count | count * int32 little-endian
    extra  = u32 count | per key: tag (b"b" bytes, b"s" str as UTF-8) | u64 length | data

The storage layer treats extra keys as opaque. The engine passes the adapter's
content identity (a digest of its weights and config, never its name or id) and
the tenant's cache salt, so a re-uploaded adapter or another tenant never shares a
key. Keys are 32-byte sha256 digests: collisions are not a practical concern, and
the same key names the same block in every tier and across restarts.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockKey = NewType("BlockKey", bytes)
"""The 32-byte sha256 digest naming a full block's content (in every tier)."""

ExtraKey = bytes | str
ExtraKeys = tuple[ExtraKey, ...]

KEY_BYTES = 32
_ROOT_TAG = b"loraplex-kv-root/1"
_BLOCK_TAG = b"loraplex-kv-block/1"
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _lp(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def root_key(fingerprint: bytes) -> BlockKey:
    """The parent key of a token list's first block; binds the model and KV layout."""
    return BlockKey(hashlib.sha256(_ROOT_TAG + _lp(fingerprint)).digest())


def encode_extra_keys(extra_keys: ExtraKeys) -> bytes:
    """The unambiguous byte encoding of ``extra_keys`` (done once per sequence)."""
    parts = [struct.pack("<I", len(extra_keys))]
    for key in extra_keys:
        if isinstance(key, bytes):
            parts.append(b"b" + _lp(key))
        elif isinstance(key, str):
            parts.append(b"s" + _lp(key.encode("utf-8")))
        else:
            # An int or object here would hash by a repr nobody chose: refuse it.
            raise TypeError(f"extra keys must be bytes or str, got {type(key).__name__}: {key!r}")
    return b"".join(parts)


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<I{len(token_ids)}i", len(token_ids), *token_ids)
    except struct.error as exc:
        bad = [t for t in token_ids if not _INT32_MIN <= t <= _INT32_MAX]
        raise ValueError(f"token ids must fit int32, got {bad[:5]}") from exc


def _hash(parent: BlockKey, token_ids: Sequence[int], encoded_extra: bytes) -> BlockKey:
    if len(parent) != KEY_BYTES:
        raise ValueError(f"a parent key is a {KEY_BYTES}-byte digest, got {len(parent)} bytes")
    h = hashlib.sha256(_BLOCK_TAG)
    h.update(parent)
    h.update(_encode_tokens(token_ids))
    h.update(encoded_extra)
    return BlockKey(h.digest())


def hash_block_tokens(parent: BlockKey, token_ids: Sequence[int], extra_keys: ExtraKeys = ()) -> BlockKey:
    """Key of one full block: ``sha256(parent, the block's token ids, extra_keys)``."""
    return _hash(parent, token_ids, encode_extra_keys(extra_keys))


def block_keys(
    token_ids: Sequence[int], block_size: int, root: BlockKey, extra_keys: ExtraKeys = ()
) -> list[BlockKey]:
    """Keys of every full block of ``token_ids`` (a trailing partial block has none)."""
    chain = BlockKeyChain(root, block_size, extra_keys)
    return list(chain.update(token_ids))


class BlockKeyChain:
    """The keys of a growing token list's full blocks, each computed once, and whose they are.

    A sequence only ever appends tokens (decode, or a prompt seen again after
    preemption), so ``update`` hashes just the blocks that became full since the
    last call. One chain per sequence; ``copy`` gives a forked sibling its own.

    ``owner`` (the tenant's cache salt, b"": nobody's) is the one record of whose blocks
    these keys name: the prefix cache tags every block it caches from this chain with it,
    so a purge finds them. It is not hashed again: it must be one of ``extra_keys``,
    which are, so a tenant's blocks are always keyed on its salt.
    """

    def __init__(
        self, root: BlockKey, block_size: int, extra_keys: ExtraKeys = (), owner: bytes = b""
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if owner and owner not in extra_keys:
            # An owner not bound into the keys would tag blocks that any other owner with the
            # same extra keys could hit. Raise even under python -O: this guards tenants.
            raise ValueError("a chain's owner must be one of its extra keys (the tenant salt is hashed)")
        self.root = root
        self.block_size = block_size
        self.extra_keys = tuple(extra_keys)
        self.owner = owner
        self._encoded_extra = encode_extra_keys(self.extra_keys)
        self._keys: list[BlockKey] = []

    @property
    def keys(self) -> list[BlockKey]:
        """Keys computed so far, one per full block, in order (do not mutate)."""
        return self._keys

    @property
    def num_hashed_tokens(self) -> int:
        return len(self._keys) * self.block_size

    def update(self, token_ids: Sequence[int]) -> list[BlockKey]:
        """Hash the full blocks of ``token_ids`` not hashed yet; return all keys.

        ``token_ids`` must extend the tokens of earlier calls: the chain cannot
        see a token changed in a block it already hashed (sequences are append-only).
        """
        if len(token_ids) < self.num_hashed_tokens:
            # A shorter list means the caller's tokens are not the ones hashed: the
            # cached keys would name KV of other tokens.
            raise ValueError(
                f"token list shrank to {len(token_ids)} tokens but {len(self._keys)} blocks of "
                f"{self.block_size} were already hashed"
            )
        bs = self.block_size
        parent = self._keys[-1] if self._keys else self.root
        for start in range(self.num_hashed_tokens, len(token_ids) - bs + 1, bs):
            parent = _hash(parent, token_ids[start : start + bs], self._encoded_extra)
            self._keys.append(parent)
        return self._keys

    def copy(self) -> BlockKeyChain:
        """An independent chain with the same keys and owner (for a forked sequence)."""
        twin = BlockKeyChain.__new__(BlockKeyChain)
        twin.root = self.root
        twin.block_size = self.block_size
        twin.extra_keys = self.extra_keys
        twin.owner = self.owner
        twin._encoded_extra = self._encoded_extra
        twin._keys = list(self._keys)
        return twin
