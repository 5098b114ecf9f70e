"""Incremental block hashing: hashing a request chunk by chunk, chained from the last
hash, equals hashing it from scratch; SGLang's array("q") token ids hash like lists; hash values are
the documented xxh3 over uint32 ids (unchanged by the numpy packing); the backend's per-request memo
hashes each block once and starts over when the tokens are not an extension."""
from __future__ import annotations

from array import array

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas_sgl.cachepool import GroupSpec, HybridCachePool, PoolConfig
from prfaas_sgl.cachepool import hashing
from prfaas_sgl.cachepool.hashing import block_hashes, extend_hashes
from prfaas_sgl.srt.cachepool_backend.hashes import HashMemo

TOKENS = st.lists(st.integers(0, 2**32 - 1), max_size=200)


def _reference(tokens: list[int], bs: int, seed: int) -> list[int]:
    """The definition in hashing.py's docstring, written out: h[i] = xxh3_64(uint32 ids of block i, h[i-1])."""
    out, parent = [], seed
    for i in range(len(tokens) // bs):
        parent = xxhash.xxh3_64_intdigest(array("I", tokens[i * bs:(i + 1) * bs]).tobytes(), parent)
        out.append(parent)
    return out


@settings(max_examples=150, deadline=None)
@given(tokens=TOKENS, bs=st.sampled_from([1, 3, 16]), seed=st.integers(0, 2**64 - 1),
       cuts=st.lists(st.integers(0, 200), max_size=6))
def test_chunk_by_chunk_equals_from_scratch(tokens, bs, seed, cuts):
    want = _reference(tokens, bs, seed)
    assert block_hashes(tokens, bs, seed) == want
    assert block_hashes(array("q", tokens), bs, seed) == want  # SGLang's token arrays
    got: list[int] = []
    for end in sorted(c for c in cuts if c <= len(tokens)) + [len(tokens)]:
        extend_hashes(got, array("q", tokens[:end]), bs, seed)
        assert got == want[:end // bs]


def _count_hashed_blocks(monkeypatch) -> list[int]:
    """Patch the chain hasher every hashing entry point runs through; count the blocks it hashes."""
    hashed, real = [0], hashing._hash_blocks

    def counting(token_ids, first, end, block_size, parent):
        out = real(token_ids, first, end, block_size, parent)
        hashed[0] += len(out)
        return out
    monkeypatch.setattr(hashing, "_hash_blocks", counting)
    return hashed


def test_memo_hashes_each_block_once_as_the_request_grows(monkeypatch):
    hashed = _count_hashed_blocks(monkeypatch)
    memo, ids = HashMemo(16, seed=5), array("q", range(1000, 1000 + 8 * 16 + 5))
    first = memo.get("r", ids[:50])  # a match on part of the prompt
    assert hashed[0] == 3
    for end in (40, 64, 100, len(ids)):  # a shorter call (a checkpoint below the match), then growth
        got = memo.get("r", ids[:end])
        assert got is first and got.tokens[:end] == ids[:end]
    assert hashed[0] == 8 and first.hashes == block_hashes(list(ids), 16, 5)


def test_a_match_hashes_only_up_to_the_first_block_the_index_lacks():
    """A match reads hashes only up to its first miss: a new 8K-block prompt costs one block. A later
    match, after the index gained blocks, goes on past the old stop; a lock or checkpoint (no `cached`)
    completes the list, equal to hashing from scratch."""
    ids = array("q", range(5000, 5000 + 16 * 8192 + 3))
    full = block_hashes(ids, 16, 5)
    index: set[int] = set()
    memo = HashMemo(16, seed=5)
    got = memo.get("r", ids, cached=index.__contains__)
    assert got.hashes == full[:1]  # cold: the first block misses
    index.update(full[:3])
    assert memo.get("r", ids, cached=index.__contains__).hashes == full[:4]  # 3 hits, then the miss
    index.update(full[:100])
    got = memo.get("r", ids, cached=index.__contains__).hashes
    assert got == full[:len(got)] and 101 <= len(got) <= 2 * 101  # past the first miss, at most 2x
    assert memo.get("r", ids).hashes == full  # completed for the pool
    assert memo.get("s", ids, cached=set(full).__contains__).hashes == full  # a full hit hashes all


def test_memo_starts_over_when_tokens_are_not_an_extension(monkeypatch):
    hashed = _count_hashed_blocks(monkeypatch)
    memo = HashMemo(16)
    memo.get("r", list(range(64)))
    stub = [7] + list(range(1, 64))  # SGLang replaces an aborted request's prompt
    got = memo.get("r", stub)
    assert hashed[0] == 8 and got.hashes == block_hashes(stub, 16)
    memo.drop("r")
    assert len(memo) == 0


def test_memo_keeps_the_most_recent_requests_and_none_without_an_id():
    memo = HashMemo(16, capacity=2)
    for rid in ("a", "b", "c"):
        memo.get(rid, list(range(32)))
    memo.get(None, list(range(32)))
    assert list(memo._by_rid) == ["b", "c"]


def test_pool_keeps_caller_kept_lists_and_hashes_only_new_blocks(monkeypatch):
    """grow(token_ids, hashes) adopts the caller's growing lists: the pool hashes nothing itself, and
    what it indexes equals hashing the final tokens from scratch."""
    groups = (GroupSpec("full", "full", 1, kv_bytes_per_token=1),
              GroupSpec("gdn", "linear", 1, state_bytes=4, checkpoint_interval=8))
    pool = HybridCachePool(PoolConfig(64, 4, groups))
    memo, ids = HashMemo(4), array("q", range(40))
    seen = memo.get("r", ids[:16])
    pool.admit("r", seen.tokens[:16] + array("q", [0]), num_tokens=16, hashes=seen.hashes[:4])
    hashed = _count_hashed_blocks(monkeypatch)
    monkeypatch.setattr(pool, "hashes", None)  # the pool must not hash on its own
    for end in (24, 40):
        seen = memo.get("r", ids[:end])
        pool.grow("r", end, seen.tokens, seen.hashes)
        pool.commit("r", end)
    assert hashed[0] == 6  # blocks 4..9, once each
    assert set(pool.managers[0].index) == set(block_hashes(list(ids), 4))
    assert set(pool.managers[1].index) == {block_hashes(list(ids), 4)[b - 1] for b in (2, 4, 6, 8, 10)}
    pool.free("r")
    pool.check_integrity()


def test_memo_keeps_the_callers_array_and_adopts_a_longer_equal_one(monkeypatch):
    """An array("q") is kept, not copied (SGLang only appends to a request's array): appends are seen
    in place. A new array that agrees on the common prefix and is longer becomes the kept one (SGLang
    rebuilt its fill ids); a shorter one leaves it; hashes are never redone."""
    want = block_hashes(list(range(70)), 16)
    hashed = _count_hashed_blocks(monkeypatch)
    memo, ids = HashMemo(16), array("q", range(40))
    got = memo.get("r", ids)
    assert got.tokens is ids and hashed[0] == 2
    ids.extend(range(40, 50))  # in place
    assert memo.get("r", ids).tokens is ids and hashed[0] == 3
    longer = array("q", range(70))
    assert memo.get("r", longer).tokens is longer and hashed[0] == 4
    assert memo.get("r", array("q", range(20))).tokens is longer
    assert got.hashes == want and hashed[0] == 4
