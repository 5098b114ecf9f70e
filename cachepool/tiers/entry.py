"""One tier entry on the wire and on disk: a fixed header, then the payload bytes.

    offset  0   4s   magic b"PFTE"
            4   H    format version
            6   B    kind (KV = full-attention KV of one block, STATE = linear state at a boundary,
                         WINDOW = the sliding-window layers' KV of one block: its window pages)
            7   B    flags (bit 0: the MAC below is set)
            8   Q    chain hash of the block (the device pool's key)
           16   Q    payload length (bytes)
           24   I    CRC-32 of the payload
           28   16s  fingerprint digest (model + layout the bytes were written for)
           44   32s  MAC: HMAC-SHA256(tier key, bytes [0, 44) + payload); zeros when written without a key
           76   ...  payload

A reader that expects another kind, hash, length, fingerprint or checksum treats the entry as absent:
bytes written by another model, another KV dtype or head layout, another TP shard, or cut short by a
crash must never be loaded into a pool. The CRC catches accidents; only the MAC stops a writer who
means harm (the fingerprint and the CRC are public functions of the bytes): a reader with a key loads
nothing whose MAC does not verify under it, unsigned entries included.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from dataclasses import dataclass
from typing import Optional

KV, STATE, WINDOW = 0, 1, 2
KINDS = {KV: "kv", STATE: "state", WINDOW: "window"}
MAGIC, VERSION = b"PFTE", 2
SIGNED = 0x01
_BODY = struct.Struct("<4sHBBQQI16s")  # what the MAC covers, with the payload
_MAC_BYTES = 32
HEADER_BYTES = _BODY.size + _MAC_BYTES


class CorruptEntry(ValueError):
    """An entry whose header or checksum does not match what the reader expects; the message says what."""


class Unauthenticated(CorruptEntry):
    """An entry whose MAC does not verify under the reader's key (unsigned, another key, or forged)."""


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


def _mac(key: bytes, body: bytes, payload) -> bytes:
    m = hmac.new(key, body, hashlib.sha256)
    m.update(payload)
    return m.digest()


def encode(fp: Fingerprint, kind: int, block_hash: int, payload: bytes, key: Optional[bytes] = None) -> bytes:
    """The entry's bytes; signed with `key` (the tier key) when given."""
    body = _BODY.pack(MAGIC, VERSION, kind, SIGNED if key else 0, block_hash, len(payload), zlib.crc32(payload),
                      fp.digest)
    return body + (_mac(key, body, payload) if key else bytes(_MAC_BYTES)) + payload


def decode(fp: Fingerprint, kind: int, block_hash: int, blob: bytes, payload_bytes: int,
           key: Optional[bytes] = None) -> bytes:
    """The payload of `blob`; raises CorruptEntry if anything differs from what the caller expects, and
    Unauthenticated if `key` is given and the entry's MAC does not verify under it."""
    if len(blob) < HEADER_BYTES:
        raise CorruptEntry(f"{len(blob)} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, k, flags, h, n, crc, digest = _BODY.unpack_from(blob)
    checks = ((magic == MAGIC, f"magic {magic!r}"), (version == VERSION, f"version {version}"),
              (k == kind, f"kind {k}, expected {kind}"), (h == block_hash, f"hash {h:x}, expected {block_hash:x}"),
              (digest == fp.digest, "written for another model/layout"),
              (n == payload_bytes, f"payload {n} bytes, expected {payload_bytes}"),
              (len(blob) == HEADER_BYTES + n, f"{len(blob) - HEADER_BYTES} payload bytes present of {n}"))
    for ok, why in checks:
        if not ok:
            raise CorruptEntry(why)
    view = memoryview(blob)
    if key is not None:
        if not flags & SIGNED:
            raise Unauthenticated("unsigned entry (written without a tier key)")
        tag = bytes(view[_BODY.size:HEADER_BYTES])
        if not hmac.compare_digest(_mac(key, bytes(view[:_BODY.size]), view[HEADER_BYTES:]), tag):
            raise Unauthenticated("MAC mismatch (written under another tier key, or forged)")
    payload = bytes(view[HEADER_BYTES:])
    if zlib.crc32(payload) != crc:
        raise CorruptEntry("checksum mismatch")
    return payload
