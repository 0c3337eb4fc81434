"""Everything that holds KV bytes, and the bookkeeping of who uses which block.

| module | owns |
|---|---|
| ``kv_cache`` | the accelerator pool's per-layer K/V tensors; block reads and writes for the tiers |
| ``kv_arena`` | ``KVPageArena``: the pool's top blocks lent to the adapter page pool (one pool, KV first) |
| ``block_pool`` | block ids, ref counts, the LRU free queue, the key index; ``on_evict`` / ``on_cache`` |
| ``block_hash`` | prefix-cache keys: a sha256 chain over token ids and extra keys; the chain's owner |
| ``prefix_cache`` | lookups of a prompt's longest cached prefix (``PrefixHit``), hit/miss counters |
| ``block_manager`` | ``KVBlockManager``: block tables, admission, copy-on-write, prefix-cache hits |
| ``block_window`` | ``BlockWindow``: the sliding window in blocks; the PAD head of each table |
| ``tiers/`` | host and disk tiers below the pool, the tier manager, ``TieredKV``: all of it as one cache |
| ``kv_events`` | ``KVEventLog``: blocks stored and removed per tier (``Medium``), for outside routers |
| ``sliced`` | ``SlicedJob``: a purge or reset as bounded pieces, run a time budget at a time between steps |

This package imports nothing from ``loraplex.platform`` or ``loraplex.adapters``, and its modules
import each other without cycles (both checked by import-linter): extra keys (adapter version,
tenant salt) arrive as opaque bytes. ``tiers/`` builds on the modules here; none of them imports it.
"""
