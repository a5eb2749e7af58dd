"""The disk tier: KV chunks in files that outlive the process, behind one `DiskTier`.

- tier.py: `DiskTier`, the one handle the engine holds (what the cache drops, written; a
  turn's dropped chunks, read back; keeps; usage);
- writes.py: `DiskWrites`, chunks copied out of the pool (spills each step, write-back);
- index.py: `DiskIndex`, the bookkeeping without files (capacity by retention value, what
  is worth reading back), shared with the simulated tier (`engine/sim/disk.py`);
- files.py: `ChunkFiles`, the chunks in checksummed files and the writer thread;
- keeps.py: `KeepJournal`, the keeps made durable in the tier's directory.

Nothing is imported here, so that the simulated tier takes the index alone.
"""
