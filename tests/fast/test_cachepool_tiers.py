"""The tier layer below the device pool (prfaas_sgl.cachepool.tiers): entry framing, the host tier's
LRU bound, demotion host -> storage over SGLang's HiCache file backend, and every fault read as a miss."""
from __future__ import annotations

import os

import pytest

from prfaas_sgl.cachepool.tiers import KV, STATE, CorruptEntry, Fingerprint, HostTier, TierStack, decode, encode
from prfaas_sgl.cachepool.tiers.entry import HEADER_BYTES

FP = Fingerprint("tiny-qwen35-hybrid|kv:2x[16,2,8]bf16|state:...|bs:64")
PAYLOAD = bytes(range(256)) * 4  # 1 KiB


def test_an_entry_round_trips_and_every_mismatch_is_named():
    blob = encode(FP, KV, 0xABC, PAYLOAD)
    assert decode(FP, KV, 0xABC, blob, len(PAYLOAD)) == PAYLOAD
    flipped = bytearray(blob)
    flipped[HEADER_BYTES + 10] ^= 1
    cases = {"checksum": (FP, KV, 0xABC, bytes(flipped), len(PAYLOAD)),
             "present of": (FP, KV, 0xABC, blob[:-5], len(PAYLOAD)),
             "another model": (Fingerprint("other-model"), KV, 0xABC, blob, len(PAYLOAD)),
             "kind": (FP, STATE, 0xABC, blob, len(PAYLOAD)),
             "hash": (FP, KV, 0xABD, blob, len(PAYLOAD)),
             "expected 1000": (FP, KV, 0xABC, blob, 1000),
             "header": (FP, KV, 0xABC, blob[:10], len(PAYLOAD))}
    for why, args in cases.items():
        with pytest.raises(CorruptEntry, match=why):
            decode(*args)


def test_the_host_tier_keeps_its_byte_bound_and_spills_least_recent_first():
    host = HostTier(3000)
    assert host.put("a", b"x" * 1000) == [] and host.put("b", b"y" * 1000) == []
    host.get("a")  # a is now more recent than b
    assert host.put("c", b"z" * 1500) == [("b", b"y" * 1000)]
    assert host.used == 2500 and "a" in host and "c" in host
    assert host.put("huge", b"h" * 4000) == [("huge", b"h" * 4000)]  # never fits: straight down


def test_without_storage_a_full_host_tier_drops_and_misses():
    stack = TierStack(FP, HostTier(2 * (HEADER_BYTES + len(PAYLOAD))), None)
    for h in (1, 2, 3):
        stack.put(KV, h, PAYLOAD)
    assert stack.get(KV, 1, len(PAYLOAD)) is None  # the oldest went nowhere
    assert stack.get(KV, 3, len(PAYLOAD)) == PAYLOAD
    assert (stack.stats.dropped, stack.stats.misses, stack.stats.host_hits) == (1, 1, 1)


def test_a_corrupt_host_entry_is_a_counted_miss_and_is_dropped():
    stack = TierStack(FP, HostTier(1 << 20), None)
    stack.put(STATE, 7, PAYLOAD)
    key = FP.key(STATE, 7)
    bad = bytearray(stack.host.get(key))
    bad[-1] ^= 0xFF
    stack.host.put(key, bytes(bad))
    assert stack.get(STATE, 7, len(PAYLOAD)) is None
    assert stack.stats.corrupt == 1 and key not in stack.host


@pytest.fixture(scope="module")
def file_backend_cls():
    from prfaas_sgl.srt.cachepool_backend.tier_storage import HiCacheFileBackend

    return HiCacheFileBackend


def _file_path(backend, key: str) -> str:
    return os.path.join(backend.path, f"{backend._file._get_suffixed_key(key)}.bin")


def test_host_overflow_is_demoted_to_sglangs_file_backend_and_read_back(tmp_path, file_backend_cls):
    store = file_backend_cls(str(tmp_path / "l3"))
    stack = TierStack(FP, HostTier(HEADER_BYTES + len(PAYLOAD)), store)
    stack.put(KV, 1, PAYLOAD)
    stack.put(KV, 2, PAYLOAD[::-1])  # pushes 1 down to the file tier
    assert stack.stats.stored == 1 and os.path.exists(_file_path(store, FP.key(KV, 1)))
    assert stack.get(KV, 1, len(PAYLOAD)) == PAYLOAD
    assert stack.get(KV, 2, len(PAYLOAD)) == PAYLOAD[::-1]
    assert (stack.stats.storage_hits, stack.stats.host_hits) == (1, 1)


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_model"])
def test_a_damaged_file_entry_is_a_miss_never_an_exception(tmp_path, file_backend_cls, damage):
    store = file_backend_cls(str(tmp_path / "l3"))
    stack = TierStack(FP, None, store)
    stack.put(STATE, 5, PAYLOAD)
    path = _file_path(store, FP.key(STATE, 5))
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[HEADER_BYTES + 1] ^= 0x40
    elif damage == "truncate":
        data = data[:len(data) // 2]
    else:
        data = bytearray(encode(Fingerprint("another model"), STATE, 5, PAYLOAD))
    open(path, "wb").write(bytes(data))
    assert stack.get(STATE, 5, len(PAYLOAD)) is None
    assert stack.stats.misses == 1
    if damage == "truncate":  # HiCacheFile raises on a short read: counted as a storage failure
        assert stack.stats.storage_errors == 1
    else:
        assert stack.stats.corrupt == 1 and not os.path.exists(path)


def test_a_full_file_tier_drops_the_entry_and_the_lookup_misses(tmp_path, file_backend_cls):
    store = file_backend_cls(str(tmp_path / "l3"), max_bytes=(HEADER_BYTES + len(PAYLOAD)) // 2)
    stack = TierStack(FP, None, store)
    stack.put(KV, 9, PAYLOAD)
    assert stack.stats.dropped == 1 and stack.get(KV, 9, len(PAYLOAD)) is None


def test_an_extension_needs_kv_for_every_block_and_a_state_at_every_boundary():
    from prfaas_sgl.cachepool.tiers.plan import extension

    hashes = list(range(10, 20))  # 10 blocks, a checkpoint every 2
    kv, states = set(hashes), {11, 13, 15, 17, 19}
    ext = lambda start, limit, kv=kv, st=states: extension(hashes, start, limit, 2, kv.__contains__,  # noqa: E731
                                                           st.__contains__)
    assert ext(0, 10) == 10
    assert ext(2, 7) == 6  # limit 7 is off the grid: the last boundary under it
    assert ext(0, 10, st=states - {15}) == 4  # no state at block 6's boundary: the chain stops before it
    assert ext(0, 10, kv=kv - {16}) == 6  # block 6 lacks KV
    assert ext(4, 10, kv=kv - {14}) == 4  # nothing past the start: the device hit stands


def test_a_removed_file_entry_gives_its_bytes_back_to_the_file_tiers_bound(tmp_path, file_backend_cls):
    """The file tier holds three entries; one turns out corrupt and is removed: a fourth entry then fits
    without evicting a good one (before, the LRU still counted the removed file and evicted entry 1)."""
    size = HEADER_BYTES + len(PAYLOAD)
    store = file_backend_cls(str(tmp_path / "l3"), max_bytes=3 * size)
    stack = TierStack(FP, None, store)
    for h in (1, 2, 3):
        stack.put(KV, h, PAYLOAD)
    bad = bytearray(open(_file_path(store, FP.key(KV, 3)), "rb").read())
    bad[-1] ^= 1
    open(_file_path(store, FP.key(KV, 3)), "wb").write(bytes(bad))
    assert stack.get(KV, 3, len(PAYLOAD)) is None and stack.stats.corrupt == 1
    stack.put(KV, 4, PAYLOAD)
    assert all(store.exists(FP.key(KV, h)) for h in (1, 2, 4))


def test_write_through_is_bounded_and_counts_what_it_drops_or_the_store_refuses():
    """The publisher never blocks the caller: with the store stalled, offers past the queue's byte bound
    are dropped and counted; once the store answers, queued entries land, and a refused put is counted."""
    import threading

    from prfaas_sgl.cachepool.tiers.publish import Publisher

    gate, seen = threading.Event(), []

    def put(kind, block_hash, payload):
        gate.wait(10)
        seen.append(block_hash)
        return 0 if block_hash == 3 else len(payload)

    pub = Publisher(put, max_queued_bytes=3 * len(PAYLOAD))  # in flight + waiting
    assert all(pub.offer(KV, h, PAYLOAD) for h in (1, 2, 3))
    assert not pub.offer(KV, 4, PAYLOAD)  # the store is stalled: past the bound, dropped at once
    gate.set()
    assert pub.flush(10)
    assert seen == [1, 2, 3]
    assert (pub.stats.published, pub.stats.publish_failed, pub.stats.publish_dropped) == (2, 1, 1)
    pub.close()
