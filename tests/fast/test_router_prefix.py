"""Prefix index: chained block hashes, LRU eviction, exact index from SGLang KV events."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import xxhash
import zmq
import zmq.asyncio

from prfaas_sgl.router.kv_events import DECODER, KVEventSubscriber, apply_batch
from prfaas_sgl.cachepool.hashing import block_hashes
from prfaas_sgl.router.prefix_index import ApproxIndex, ExactIndex

pytestmark = pytest.mark.timeout(30)

# Bytes produced by sglang 0.5.23's own encoder (msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0,
# events=[BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=range(8), block_size=4,
# lora_id=None, medium="GPU"), BlockRemoved(block_hashes=[12], medium="GPU"), AllBlocksCleared()],
# attn_dp_rank=0))), captured once with /work/main/.venv; pins our decoder to the real wire format.
SGLANG_BATCH = bytes.fromhex(
    "93cb3ff00000000000009387a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920b0cb17061"
    "72656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980001020304050607aa626c6f636b5f73697a6504a7"
    "6c6f72615f6964c0a66d656469756da347505583a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173"
    "686573910ca66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400")


def test_block_hashes_are_chained_xxh3_over_full_blocks():
    """The router hashes with the cache pool's function (chain seed 0), so both sides name a block alike."""
    toks = list(range(10))
    h = block_hashes(toks, 4)
    assert len(h) == 2  # tokens 8..9 form a partial block: never hashed
    raw = lambda xs: b"".join(x.to_bytes(4, "little") for x in xs)  # noqa: E731
    h0 = xxhash.xxh3_64_intdigest(raw(range(4)), seed=0)
    assert h == [h0, xxhash.xxh3_64_intdigest(raw(range(4, 8)), seed=h0)]
    # Same second block after a different first block: different hash (chaining).
    assert block_hashes([9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != h[1]


def test_approx_index_match_and_leaf_first_lru_eviction():
    idx = ApproxIndex(capacity_blocks=4)
    a = block_hashes(list(range(12)), 4)  # 3 blocks
    idx.insert(a)
    assert idx.match(a) == 3 and idx.match(block_hashes(list(range(8)) + [99] * 4, 4)) == 2
    b = block_hashes([50 + i for i in range(8)], 4)  # 2 more blocks: one of a must go
    idx.insert(b)
    assert len(idx) == 4 and idx.match(b) == 2
    assert idx.match(a) == 2  # a's leaf was evicted, its parents kept
    idx.insert(a[:1])  # touching a prefix refreshes it
    idx.insert(block_hashes([70 + i for i in range(4)], 4))
    assert idx.match(a) == 1


def test_exact_index_follows_stored_removed_cleared():
    idx = ExactIndex(block_size=4)
    apply_batch(idx, DECODER.decode(SGLANG_BATCH))
    assert len(idx) == 0  # stored 2, removed 1, then all cleared
    ours = block_hashes(list(range(8)), 4)
    idx.stored([11, 12], None, list(range(8)), 4, "GPU")
    assert idx.match(ours) == 2
    idx.stored([13], 12, [8, 9, 10, 11], 4, "GPU")  # child of server block 12
    assert idx.match(block_hashes(list(range(12)), 4)) == 3
    idx.stored([12], 11, [4, 5, 6, 7], 4, "CPU_PINNED")  # also on host memory
    idx.removed([12], "GPU")
    assert idx.match(ours) == 2  # still held by CPU_PINNED
    idx.removed([12], "CPU_PINNED")
    assert idx.match(ours) == 1
    idx.stored([99], 12345, [1, 2, 3, 4], 4, "GPU")
    assert idx.orphans == 1
    idx.stored([98], None, [1, 2], 2, "GPU")
    assert idx.mismatched == 1


def test_decoder_reads_sglang_bytes():
    batch = DECODER.decode(SGLANG_BATCH)
    assert batch.ts == 1.0 and batch.attn_dp_rank == 0
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert batch.events[0].token_ids == list(range(8)) and batch.events[0].parent_block_hash is None


def test_subscriber_over_zmq():
    async def body():
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        idx = ExactIndex(block_size=4)
        sub = KVEventSubscriber(ctx, f"tcp://127.0.0.1:{port}", idx)
        sub.start()
        stored = [1.0, [{"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": None,
                         "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
                         "session_id": "new-field-ignored"}], None]
        payload = msgspec.msgpack.encode(stored)
        for seq in range(200):  # PUB/SUB join is asynchronous: publish until the subscriber has it
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            await asyncio.sleep(0.01)
            if idx.match(block_hashes(list(range(8)), 4)) == 2:
                break
        assert idx.match(block_hashes(list(range(8)), 4)) == 2
        assert sub.gaps == 0 and sub.last_seq is not None
        await sub.close()
        pub.close()
        ctx.term()
    asyncio.run(body())
