"""Everything that holds KV bytes, and the bookkeeping of who uses which block.

| module | owns |
|---|---|
| ``kv_cache`` | the per-layer K/V tensors of the accelerator pool and the block count a budget buys |
| ``block_pool`` | physical block ids, ref counts, the LRU free queue, the key -> block index of cached blocks |
| ``block_hash`` | prefix-cache keys: a sha256 chain over token ids and extra keys, length-prefixed |
| ``prefix_cache`` | lookups of a prompt's longest cached prefix (``PrefixHit``) and hit/miss counters |
| ``block_manager`` | ``KVBlockManager``: block tables, admission, copy-on-write, prefix-cache hits |

This package imports nothing from ``loraplex.platform`` or ``loraplex.adapters`` (checked by
import-linter): extra keys (adapter version, tenant salt) arrive as opaque bytes.
"""
