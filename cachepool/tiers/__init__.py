"""Lower tiers of the hybrid prefix cache: host memory and a storage backend below the device pool.

An entry is the bytes of one entry the device pool evicted (the full-attention KV of one index block, the
linear-attention state at one checkpoint boundary, or the sliding-window layers' KV of one block: its
window pages), keyed by the pool's chained block hash and framed with a header that names the
model/layout it was written for, a checksum and, under a tier key (`auth.py`), a MAC (`entry.py`).
`TierStack` (stack.py) demotes entries device -> host -> storage and answers lookups host first; every
fault below it (store down, corrupt or truncated entry, wrong model, tier full) is a miss, never an
exception into the scheduler. Plain Python (no torch, no sglang): callers hand in and take out bytes.
"""
from .entry import KV, KINDS, STATE, WINDOW, CorruptEntry, Fingerprint, Unauthenticated, decode, encode, entry_size
from .host import HostTier
from .stack import TierStack, TierStats
from .storage import MooncakeStoreBackend, StorageBackend

__all__ = ["KV", "KINDS", "MooncakeStoreBackend", "STATE", "CorruptEntry", "Fingerprint", "HostTier", "StorageBackend",
           "TierStack", "TierStats", "Unauthenticated", "WINDOW", "decode", "encode", "entry_size"]
