"""Block keys: chained, bound to the root fingerprint and extra keys, unambiguously encoded."""

from __future__ import annotations

import hashlib
import struct

import pytest

from loraplex.storage.kv.block_hash import (
    BlockKey,
    BlockKeyChain,
    ExtraKeys,
    block_keys,
    encode_extra_keys,
    hash_block_tokens,
    root_key,
)

ROOT = root_key(b"model-a/layout-1")


def test_key_is_sha256_of_the_documented_encoding() -> None:
    key = hash_block_tokens(ROOT, [1, 2, 300], ("ad", b"\x00s"))
    expected = hashlib.sha256(
        b"loraplex-kv-block/1"
        + ROOT
        + struct.pack("<I3i", 3, 1, 2, 300)
        + struct.pack("<I", 2)
        + b"s"
        + struct.pack("<Q", 2)
        + b"ad"
        + b"b"
        + struct.pack("<Q", 2)
        + b"\x00s"
    ).digest()
    assert key == expected and len(key) == 32
    fingerprint = b"model-a/layout-1"
    assert (
        root_key(fingerprint)
        == hashlib.sha256(b"loraplex-kv-root/1" + struct.pack("<Q", 16) + fingerprint).digest()
    )


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("ab", "c"), ("a", "bc")),  # concatenation would collide
        (("abc",), ("ab", "c")),
        (("",), ()),  # an empty salt is still a salt
        (("", ""), ("",)),
        ((b"ab",), ("ab",)),  # bytes vs str of the same bytes
        (("adapter-digest", "tenant-1"), ("tenant-1", "adapter-digest")),  # order matters
        (("x",), ("y",)),
    ],
)
def test_different_extra_keys_give_different_keys(a: ExtraKeys, b: ExtraKeys) -> None:
    assert encode_extra_keys(a) != encode_extra_keys(b)
    assert hash_block_tokens(ROOT, [5, 6], a) != hash_block_tokens(ROOT, [5, 6], b)


def test_same_inputs_same_key_and_root_binds_fingerprint() -> None:
    assert hash_block_tokens(ROOT, [1, 2], ("a",)) == hash_block_tokens(ROOT, [1, 2], ("a",))
    other_root = root_key(b"model-b/layout-1")
    assert hash_block_tokens(other_root, [1, 2], ("a",)) != hash_block_tokens(ROOT, [1, 2], ("a",))
    # Token lists that would share bytes without the count: [1] + [0] vs [1, 0] etc.
    assert hash_block_tokens(ROOT, [1, 0]) != hash_block_tokens(ROOT, [1])
    assert hash_block_tokens(ROOT, [256]) != hash_block_tokens(ROOT, [0, 1])


def test_chain_binds_the_whole_prefix() -> None:
    # Same second block, different first block: different second key.
    k1 = block_keys([1, 2, 3, 4], 2, ROOT)
    k2 = block_keys([9, 9, 3, 4], 2, ROOT)
    assert k1[1] != k2[1]
    assert k1[1] == hash_block_tokens(hash_block_tokens(ROOT, [1, 2]), [3, 4])
    # Different block sizes never share keys, even over the same tokens.
    assert block_keys([1, 2, 3, 4], 4, ROOT)[0] != block_keys([1, 2, 3, 4], 2, ROOT)[0]


def test_chain_is_incremental_and_matches_batch() -> None:
    tokens = list(range(100, 123))  # 23 tokens, bs 4 -> 5 full blocks
    chain = BlockKeyChain(ROOT, 4, ("lora", b"salt"))
    assert chain.update(tokens[:3]) == []
    assert len(chain.update(tokens[:9])) == 2
    first_two = list(chain.keys)
    assert chain.update(tokens) == block_keys(tokens, 4, ROOT, ("lora", b"salt"))
    assert chain.keys[:2] == first_two
    assert chain.num_hashed_tokens == 20
    twin = chain.copy()
    twin.update([*tokens, 1])
    assert len(twin.keys) == 6 and len(chain.keys) == 5


def test_chain_refuses_a_shrinking_token_list_and_bad_inputs() -> None:
    chain = BlockKeyChain(ROOT, 2)
    chain.update([1, 2, 3, 4])
    with pytest.raises(ValueError, match="shrank"):
        chain.update([1, 2, 3])
    with pytest.raises(ValueError, match="int32"):
        hash_block_tokens(ROOT, [2**31])
    with pytest.raises(TypeError, match="bytes or str"):
        hash_block_tokens(ROOT, [1], (7,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="32-byte"):
        hash_block_tokens(BlockKey(b"short"), [1])
