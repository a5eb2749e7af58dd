"""The KV cache's bookkeeping, pure Python: block free lists, chunk tables, the retention
policy and its profiled cost, and `KVCacheManager` (manager.py), the only writer of the
tables, over its parts: tier accounting (tiers.py), the eviction order (order.py), eviction
(eviction.py), shared prefixes (sharing.py), a prefetch's swap-in (swap_in_ahead.py) and
the chunks headed for the disk tier (to_disk.py). It returns the copies it needs; it never
touches a tensor."""
