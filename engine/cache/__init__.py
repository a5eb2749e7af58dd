"""The KV cache's bookkeeping, pure Python: block free lists, chunk tables, the retention
policy and its profiled cost, and `KVCacheManager` (manager.py), the only writer of the
tables. It returns the copies it needs; it never touches a tensor."""
