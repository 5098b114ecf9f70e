"""One tier entry on the wire and on disk: a fixed header, then the payload bytes.

    offset  0   4s   magic b"PFTE"
            4   H    format version
            6   B    kind (KV = full-attention KV of one block, STATE = linear state at a boundary)
            7   x    pad
            8   Q    chain hash of the block (the device pool's key)
           16   Q    payload length (bytes)
           24   I    CRC-32 of the payload
           28   16s  fingerprint digest (model + layout the bytes were written for)
           44   ...  payload

A reader that expects another kind, hash, length, fingerprint or checksum treats the entry as absent:
bytes written by another model, another KV dtype or head layout, another TP shard, or cut short by a
crash must never be loaded into a pool.
"""
from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

KV, STATE = 0, 1
KINDS = {KV: "kv", STATE: "state"}
MAGIC, VERSION = b"PFTE", 1
_HEADER = struct.Struct("<4sHBxQQI16s")
HEADER_BYTES = _HEADER.size


class CorruptEntry(ValueError):
    """An entry whose header or checksum does not match what the reader expects; the message says what."""


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What makes bytes loadable: the model, the layout of its KV and state tensors (shapes, dtypes,
    TP shard), the index block size and hash seed. `text` is any stable description of all of these."""

    text: str

    @property
    def digest(self) -> bytes:
        return hashlib.blake2b(self.text.encode(), digest_size=16).digest()

    def key(self, kind: int, block_hash: int) -> str:
        """The storage key: fingerprint first, so two models never share a key space."""
        return f"pfx-{self.digest.hex()[:16]}-{KINDS[kind]}-{block_hash:016x}"


def entry_size(payload_bytes: int) -> int:
    return HEADER_BYTES + payload_bytes


def encode(fp: Fingerprint, kind: int, block_hash: int, payload: bytes) -> bytes:
    head = _HEADER.pack(MAGIC, VERSION, kind, block_hash, len(payload), zlib.crc32(payload), fp.digest)
    return head + payload


def decode(fp: Fingerprint, kind: int, block_hash: int, blob: bytes, payload_bytes: int) -> bytes:
    """The payload of `blob`; raises CorruptEntry if anything differs from what the caller expects."""
    if len(blob) < HEADER_BYTES:
        raise CorruptEntry(f"{len(blob)} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, k, h, n, crc, digest = _HEADER.unpack_from(blob)
    checks = ((magic == MAGIC, f"magic {magic!r}"), (version == VERSION, f"version {version}"),
              (k == kind, f"kind {k}, expected {kind}"), (h == block_hash, f"hash {h:x}, expected {block_hash:x}"),
              (digest == fp.digest, "written for another model/layout"),
              (n == payload_bytes, f"payload {n} bytes, expected {payload_bytes}"),
              (len(blob) == HEADER_BYTES + n, f"{len(blob) - HEADER_BYTES} payload bytes present of {n}"))
    for ok, why in checks:
        if not ok:
            raise CorruptEntry(why)
    payload = bytes(memoryview(blob)[HEADER_BYTES:])
    if zlib.crc32(payload) != crc:
        raise CorruptEntry("checksum mismatch")
    return payload
