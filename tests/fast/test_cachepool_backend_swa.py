"""prfaas_hybrid for a sliding-window hybrid (docs/cachepool-swa.md) over SGLang's real
SWATokenToKVPoolAllocator (full slots with SWA peers through full_to_swa_index_mapping), its real
ReqKvInfo and its real window eviction (BasePrefixCache.evict_sliding_windows), driven like the scheduler:
match + lock, chunked-prefill checkpoints, decode steps that slide the window, releases, evictions.

After every step:
- every full slot is exactly one of free / cached / a live row's, and every SWA slot exactly one of free /
  the peer of one full slot (no SWA page leaked, freed twice or shared);
- a live full slot has a peer only if the tree's SWA index or a live row's window needs it... checked as:
  a cached full entry has peers iff its hash is in the SWA index, unless a live row holds it;
- every live request's window (the keys its next token reads) is live and holds the right tokens;
- SGLang's size queries equal a recount (swa_evictable + swa_protected == window pages the tree owns).
And on every hit, the prefix's full slots and the window's SWA pages hold the prompt's own tokens.
"""
from __future__ import annotations

from array import array
from types import SimpleNamespace as NS

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sglang.srt.managers.schedule_batch import ReqKvInfo
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from prfaas_sgl.srt.cachepool_backend import cache as backend

FULL_SLOTS, SWA_SLOTS, ROWS, CHUNK, SWS = 768, 512, 4, 32, 23  # SGLang's sliding_window_size 23: reads 24
PREFIXES = [list(range(1000, 1200)), list(range(5000, 5200))]


class _Kv(BaseSWAKVPool):
    """The parts of an SWA KV pool the allocator touches (no tensors: slots are bookkeeping here)."""

    full_kv_pool = swa_kv_pool = None

    def register_mapping(self, mapping):
        self.full_to_swa_index_mapping = mapping

    def translate_loc_from_full_to_swa(self, idx):
        return self.full_to_swa_index_mapping[idx]


_Kv.__abstractmethods__ = frozenset()


def allocator() -> SWATokenToKVPoolAllocator:
    return SWATokenToKVPoolAllocator(FULL_SLOTS, SWA_SLOTS, 1, torch.float32, "cpu", object.__new__(_Kv), False)


def ctx(alloc, mode="null", ssm=False, full_tokens=100):
    rtp = NS(req_to_token=torch.zeros((ROWS, 320), dtype=torch.int32))
    params = NS(page_size=1, token_to_kv_pool_allocator=alloc, req_to_token_pool=rtp, sliding_window_size=SWS)
    return NS(params=params, server_args=NS(chunked_prefill_size=CHUNK, disaggregation_mode=mode),
              is_hybrid_ssm=ssm, is_hybrid_swa=True, enable_hierarchical_cache=False, disable_radix_cache=False,
              full_tokens_per_layer=full_tokens)


def strict(alloc) -> None:
    """SGLang's allocator trusts its callers (its own checks are off by default): refuse a free of a
    slot already free, a window free of a slot without a peer, a full-only free of one with a peer."""
    mapping, full, swa = alloc.full_to_swa_index_mapping, alloc.full_attn_allocator, alloc.swa_attn_allocator
    real_free, real_swa, real_full = alloc.free, alloc.free_swa, alloc.free_full

    def not_free(idx):
        got = idx.reshape(-1).tolist()
        assert len(set(got)) == len(got) and not set(got) & set(full.free_pages.tolist()), "full double free"

    def free(idx):
        not_free(idx)
        assert bool((mapping[idx] > 0).all()), "free() of a slot whose window page is gone"
        real_free(idx)

    def free_swa(idx):
        assert bool((mapping[idx] > 0).all()), "window free of a slot without a peer"
        peers = mapping[idx].tolist()
        assert not set(peers) & set(swa.free_pages.tolist()), "SWA double free"
        real_swa(idx)

    def free_full(idx):
        not_free(idx)
        assert bool((mapping[idx] == 0).all()), "full-only free of a slot whose window page is live"
        real_full(idx)
    alloc.free, alloc.free_swa, alloc.free_full = free, free_swa, free_full


def tag(tokens, p: int) -> int:
    return hash(tuple(tokens[:p + 1]))


class SwaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = allocator()
        strict(self.alloc)
        c = self.cache = backend.build(ctx(self.alloc))
        self.rtp, self.map = c.req_to_token_pool, self.alloc.full_to_swa_index_mapping
        self.full_tag: dict[int, int] = {}  # full slot -> the token prefix whose KV it holds
        self.swa_tag: dict[int, int] = {}  # SWA slot -> the same
        self.live: dict[int, list] = {}  # row -> [req, node, lock, computed]
        self.n = 0

    def _alloc(self, need: int):
        a = self.alloc
        short_full, short_swa = need - a.full_available_size(), need - a.swa_available_size()
        if short_full > 0 or short_swa > 0:
            self.cache.evict(EvictParams(num_tokens=max(0, short_full), swa_num_tokens=max(0, short_swa)))
        return a.alloc(need)

    def _write(self, req, row: int, start: int, slots) -> None:
        tokens = req.full_untruncated_fill_ids
        self.rtp.req_to_token[row, start:start + len(slots)] = slots.to(torch.int32)
        for j, s in enumerate(slots.tolist()):
            self.full_tag[s] = self.swa_tag[int(self.map[s])] = tag(tokens, start + j)

    @precondition(lambda self: len(self.live) < ROWS)
    @rule(p=st.integers(0, 1), cut=st.integers(0, 200), tail=st.lists(st.integers(0, 3), max_size=40))
    def start(self, p, cut, tail):
        tokens = PREFIXES[p][:cut] + tail
        if len(tokens) < 2:
            return
        row = min(set(range(ROWS)) - set(self.live))
        c, kv, done = self.cache, ReqKvInfo(req_pool_idx=row), [False]
        req = NS(rid=f"r{self.n}", extra_key=None, cache_salt=None, full_untruncated_fill_ids=array("q", tokens),
                 kv=kv, finished=lambda: done[0], done=done)
        self.n += 1
        key = RadixKey(array("q", tokens[:-1]))
        node = c.match_prefix(MatchPrefixParams(key=key, req=req, cow_mamba=False)).last_device_node
        lock = c.inc_lock_ref(node)
        prefix, k = c.path_device_indices(node), len(node.tokens)
        for q in range(k):  # the hit: the prompt's own KV, and its window's pages live
            assert self.full_tag[int(prefix[q])] == tag(tokens, q)
            if q >= k - SWS:
                assert int(self.map[prefix[q]]) > 0, f"hit at {k}: window page {q} is gone"
                assert self.swa_tag[int(self.map[prefix[q]])] == tag(tokens, q)
        fresh = self._alloc(len(tokens) - k)
        if fresh is None:  # no room: the scheduler would keep it waiting
            c.dec_lock_ref(node, lock.to_dec_params())
            return
        self.rtp.req_to_token[row, :k] = prefix.to(torch.int32)
        self._write(req, row, k, fresh)
        kv.cache_protected_len, kv.kv_allocated_len = k, len(tokens)
        self.live[row] = [req, node, lock, k]

    @precondition(lambda self: any(len(e[0].full_untruncated_fill_ids) > e[3] for e in self.live.values()))
    @rule(data=st.data())
    def chunk_end(self, data):
        rows = sorted(r for r, e in self.live.items() if len(e[0].full_untruncated_fill_ids) > e[3])
        entry = self.live[data.draw(st.sampled_from(rows))]
        req = entry[0]
        end = min(entry[3] + CHUNK, len(req.full_untruncated_fill_ids))
        self.cache.checkpoint(req, up_to=end)
        entry[3] = end

    @precondition(lambda self: any(len(e[0].full_untruncated_fill_ids) == e[3] for e in self.live.values()))
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=40), checkpoint=st.booleans())
    def decode(self, data, new, checkpoint):
        """Decode steps: each a new token's slot, then SGLang's window eviction behind it; maybe a
        checkpoint of the running request after them (SGLang's PD decode does one; the backend must
        not hand the tree pages the request frees later)."""
        rows = sorted(r for r, e in self.live.items() if len(e[0].full_untruncated_fill_ids) == e[3])
        row = data.draw(st.sampled_from(rows))
        entry = self.live[row]
        req = entry[0]
        for token in new:
            if entry[3] >= self.rtp.req_to_token.shape[1]:
                break
            slot = self._alloc(1)
            if slot is None:
                break
            req.full_untruncated_fill_ids.append(token)
            self._write(req, row, entry[3], slot)
            entry[3] += 1
            req.kv.kv_allocated_len = entry[3]
            self.cache.evict_sliding_windows(req, entry[3] - 1)
        if checkpoint:
            self.cache.checkpoint(req, up_to=entry[3])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        """release_kv_cache: final checkpoint, free the row but the tree's part, unlock, on_release."""
        row = data.draw(st.sampled_from(sorted(self.live)))
        req, node, lock, _ = self.live.pop(row)
        c, n = self.cache, len(req.full_untruncated_fill_ids)  # its last chunk runs, then it finishes
        req.done[0] = True
        c.checkpoint(req, up_to=n)
        c.free_kv_row(req.kv, [(req.kv.cache_protected_len, n)])
        c.dec_lock_ref(node, lock.to_dec_params())
        c.on_release(req, checkpointed=True)

    @rule(tokens=st.integers(0, 200), windows=st.integers(0, 200))
    def evict(self, tokens, windows):
        self.cache.evict(EvictParams(num_tokens=tokens, swa_num_tokens=windows))

    @invariant()
    def slots_conserved(self):
        mirror, a = self.cache.mirror, self.alloc
        cached = set(mirror.kv_slots(list(mirror.kv_of)).tolist())
        rows = set()
        for r, e in self.live.items():
            rows |= set(self.rtp.req_to_token[r, len(e[1].tokens):len(e[0].full_untruncated_fill_ids)].tolist())
        free = a.full_attn_allocator.free_pages.tolist()
        assert len(free) == len(set(free)) and not set(free) & (cached | rows), "a full slot is free and held"
        assert len(free) + len(cached | rows) == FULL_SLOTS, "full slots leaked"
        assert bool((self.map[torch.tensor(free, dtype=torch.int64)] == 0).all()), "a free full slot kept its peer"
        peers = self.map[:FULL_SLOTS + 1][self.map[:FULL_SLOTS + 1] > 0].tolist()
        swa_free = a.swa_attn_allocator.free_pages.tolist()
        assert len(peers) == len(set(peers)), "an SWA page is the peer of two full slots"
        assert not set(peers) & set(swa_free) and len(swa_free) == len(set(swa_free)), "an SWA page is free and held"
        assert len(peers) + len(swa_free) == SWA_SLOTS, "SWA pages leaked"
        in_rows = rows | {s for r, e in self.live.items()
                          for s in self.rtp.req_to_token[r, :len(e[0].full_untruncated_fill_ids)].tolist()}
        for h, b in mirror.kv_of.items():  # a cached block's pages are the tree's iff SWA indexes it
            slots = mirror.kv_table[b]
            if h in mirror.swa_of:
                assert bool((self.map[slots] > 0).all())
            elif not set(slots.tolist()) & in_rows:
                assert bool((self.map[slots] == 0).all()), "an unindexed cached block kept window pages"

    @invariant()
    def live_windows_readable(self):
        for r, (req, _, _, computed) in self.live.items():
            tokens = req.full_untruncated_fill_ids
            for q in range(max(0, computed - SWS), computed):
                s = int(self.rtp.req_to_token[r, q])
                assert int(self.map[s]) > 0, f"row {r}: window page {q} freed while the request runs"
                assert self.swa_tag[int(self.map[s])] == tag(tokens, q)

    @invariant()
    def sizes_equal_a_recount(self):
        c, blocks = self.cache, self.cache.pool.blocks
        idle = {m.name: 0 for m in c.pool.managers}
        for b in blocks.lru_blocks():
            idle[blocks.owner[b].name] += 1
        assert c.full_evictable_size() == idle["full"] * c.bs
        assert c.swa_evictable_size() == idle["swa"] * c.bs
        assert c.swa_evictable_size() + c.swa_protected_size() == len(c.mirror.swa_of) * c.bs
        assert c.full_evictable_size() + c.full_protected_size() == len(c.mirror.kv_of) * c.bs
        c.check_integrity()


TestSwaMachine = SwaMachine.TestCase
TestSwaMachine.settings = settings(max_examples=25, stateful_step_count=40, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])


def _prefill(cache, row: int, tokens: list[int], alloc, finish: bool = True):
    """One request computed in CHUNK-token chunks (and released if finish); returns its ReqKvInfo."""
    done = [False]
    kv = ReqKvInfo(req_pool_idx=row)
    req = NS(rid=f"p{row}{tokens[0]}", extra_key=None, cache_salt=None, full_untruncated_fill_ids=array("q", tokens),
             kv=kv, finished=lambda: done[0])
    cache.req_to_token_pool.req_to_token[row, :len(tokens)] = alloc.alloc(len(tokens)).to(torch.int32)
    for end in range(CHUNK, len(tokens), CHUNK):
        cache.checkpoint(req, up_to=end)
    if finish:
        done[0] = True
        cache.checkpoint(req, up_to=len(tokens))
        cache.free_kv_row(kv, [(0, len(tokens))])
        cache.on_release(req, checkpointed=True)
    return req


def _hit(cache, tokens: list[int]) -> int:
    req = NS(rid="probe", kv=ReqKvInfo())
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req)).device_prefix_len


def test_hit_past_the_window_needs_only_the_window_pages():
    """After window-page eviction (oldest first: the out-of-window blocks a prefill trimmed), a
    120-token prefix still hits at 112 and only blocks [5, 7) keep SWA pages (window 24 tokens)."""
    alloc = allocator()
    strict(alloc)
    cache = backend.build(ctx(alloc))
    tokens = list(range(100, 220))
    _prefill(cache, 0, tokens, alloc)
    assert _hit(cache, tokens + [1]) == 112
    cache.evict(EvictParams(swa_num_tokens=5 * 16))
    hashes = cache.pool.hashes(tokens)
    assert {hashes.index(h) for h in cache.mirror.swa_of} == {5, 6}
    assert len(cache.mirror.kv_of) == 7 and _hit(cache, tokens + [1]) == 112
    window = cache.mirror.kv_slots(hashes[5:7])
    assert bool((alloc.full_to_swa_index_mapping[window] > 0).all())
    assert alloc.swa_available_size() == SWA_SLOTS - 32  # every other window page went back
    cache.check_integrity()


def test_evicting_full_entries_takes_their_window_pages():
    alloc = allocator()
    strict(alloc)
    cache = backend.build(ctx(alloc))
    tokens = list(range(100, 220))
    _prefill(cache, 0, tokens, alloc)
    result = cache.evict(EvictParams(num_tokens=FULL_SLOTS))
    assert result.num_tokens_evicted == 7 * 16 and result.swa_num_tokens_evicted == 7 * 16
    assert not cache.mirror.kv_of and not cache.mirror.swa_of and _hit(cache, tokens + [1]) == 0
    assert alloc.full_available_size() == FULL_SLOTS and alloc.swa_available_size() == SWA_SLOTS
    cache.check_integrity()


def test_a_running_prefill_keeps_its_checkpointed_pages_from_window_eviction():
    """A checkpoint raises swa_evict_floor over what the tree took, so SGLang's window eviction during
    decode frees only the request's own later pages (not tree-owned ones)."""
    alloc = allocator()
    strict(alloc)
    cache = backend.build(ctx(alloc))
    req = _prefill(cache, 0, list(range(100, 200)), alloc, finish=False)
    assert req.kv.swa_evict_floor == 96
    cache.evict_sliding_windows(req, 99)  # the cursor stops at the floor: nothing tree-owned is freed
    cache.check_integrity()


def test_swa_plus_linear_and_all_swa_models_are_refused():
    with pytest.raises(ValueError, match="both sliding-window and linear-attention"):
        backend.build(ctx(allocator(), ssm=True))
    with pytest.raises(ValueError, match="needs full-attention layers"):
        backend.build(ctx(allocator(), full_tokens=0))
    no_window = ctx(allocator())
    no_window.params.sliding_window_size = None
    with pytest.raises(ValueError, match="needs the model's sliding_window_size"):
        backend.build(no_window)


def test_groups_and_window_follow_sglang():
    cache = backend.build(ctx(allocator()))
    assert type(cache) is backend.SlidingWindowCache
    assert [(m.kind, getattr(m.spec, "window", 0)) for m in cache.pool.managers] == [("full", 0), ("swa", SWS + 1)]
    assert cache.supports_swa() and not cache.supports_mamba() and cache.sliding_window_size == SWS


class _Draw:
    def __init__(self, value):
        self.value = value

    def draw(self, strategy):
        return self.value


def test_finish_after_window_eviction_indexes_no_freed_page_and_frees_the_straddling_block():
    """40-token prompt (2 chunks: the tree takes blocks 0-1, the floor is 32), 40 decode steps (SGLang frees
    the row's pages [32, 56)), finish: blocks 2 (all freed) and 3 (half freed) are taken as full-attention KV
    only, block 4 with its pages; block 3's live half goes back at release."""
    m = SwaMachine()
    m.start(p=0, cut=40, tail=[])
    m.chunk_end(_Draw(0))
    m.chunk_end(_Draw(0))
    req = m.live[0][0]
    assert req.kv.swa_evict_floor == 32
    m.decode(_Draw(0), [1] * 40, False)
    assert req.kv.get_evicted_seqlen(ComponentType.SWA) == 56
    m.release(_Draw(0))
    c = m.cache
    hashes = c.pool.hashes(list(range(1000, 1040)) + [1] * 40)
    assert sorted(hashes.index(h) for h in c.mirror.kv_of) == [0, 1, 2, 3, 4]
    assert sorted(hashes.index(h) for h in c.mirror.swa_of) == [0, 1, 4]
    assert m.alloc.swa_available_size() == SWA_SLOTS - 3 * 16  # nothing else kept a page
    m.slots_conserved()
    m.sizes_equal_a_recount()
