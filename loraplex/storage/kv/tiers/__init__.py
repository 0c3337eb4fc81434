"""The KV tiers below the accelerator pool (host RAM, disk), and ``TieredKV``: all of it as one cache.

| module | owns |
|---|---|
| ``tiered_kv`` | ``TieredKV``: block manager + tiers as one cache, wired; reset, purge, persist, checks |
| ``contracts`` | ``Tier``, ``Location``, the device block I/O protocol; the one-location rule |
| ``host_pool`` | ``HostKVPool``: block slots in host RAM (pinned on CUDA), LRU |
| ``disk_pool`` | ``DiskKVPool``: capped, checksummed block files, async I/O, warm restart |
| ``disk_slots`` / ``disk_files`` / ``block_codec`` | the disk slot states, slot files, record format |
| ``disk_io`` / ``disk_erase`` | the disk I/O workers, fsyncs, fault counts; erasing records (clear, purge) |
| ``manager`` | ``TierManager``: the tiers' one door: demote, look up, promote, swap, discard, purge |
| ``placement`` | ``TierPlacement``: where a block is below the device; the demotion policy |
| ``promoter`` | ``Promoter``: promotions in flight, the keys they hold (moving, superseded) |
| ``transfers`` / ``metrics`` | promotion and swap handles (``PromotionMover``); per-tier counters |
| ``prefix_promotion`` | ``start_promotion`` / ``finish_promotion``: a prefix hit continued from host/disk |

The tiers build on the device side one level up (``kv_cache``, ``block_manager``, ``kv_events``,
``sliced``), which never imports them; their modules import each other without cycles (checked
by import-linter).
"""
