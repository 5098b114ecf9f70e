"""PrfaasHybridCache: what every kind of prfaas_hybrid cache shares (SGLang's BasePrefixCache over one
HybridCachePool whose full-attention group indexes SGLang's KV slots).

Ownership of a running request's KV row (page size 1, block size bs):

    row positions  [0, protected)        tree's slots, matched at admission, pinned by req.lock
                   [protected, up_to)    the request's own slots; at each checkpoint the blocks
                                         whose hash is new are handed to the tree (`stored`), the
                                         rest stay private (duplicates) and are freed at release

Each SGLang request is one pool request (`admit` at its first checkpoint, `grow`+`commit` at each
later one, `free` at release), so the pool's references pin exactly what the row reads. A lock on a
match handle is a pool request of its own over the matched tokens.

A kind (linear.py, sliding.py, decode_kv.py) adds its pool group and answers the few questions that
differ: what a hit needs besides KV (`_matched`), what a checkpoint offers besides KV blocks
(`_state_at`: a state at its end; `_stage`: window pages), what a row release frees besides KV
(`_free_windows`), which group to evict first (`_evict_group`), and its own size counters.
"""
from __future__ import annotations

import itertools
import logging
from array import array
from types import MappingProxyType

import torch
from sglang.srt.mem_cache.base_prefix_cache import (BasePrefixCache, DecLockRefResult, EvictParams,
                                                    EvictResult, IncLockRefResult, MatchPrefixParams,
                                                    MatchResult)

from prfaas_sgl.cachepool import GroupSpec, HybridCachePool, PoolConfig

from . import config as backend_config
from . import row_free
from .hashes import HashMemo
from .mirror import FULL, Insert, Mirror
from .swa import SWA, SwaMemory

log = logging.getLogger(__name__)


_ONE_TOKEN = array("q", [0])  # see checkpoint


class Node:
    """A match handle: tokens [0, length) of `ids` and their block hashes (length == bs * len(hashes)).
    `ids` is the request's own array, not a copy (128K ids are a 1 MB copy per match); only `hashes`
    is read on the request path (lock, slots), and SGLang only appends to the array while the request
    lives (hashes.py says when it is rewritten). Compared by identity."""

    __slots__ = ("ids", "length", "hashes")
    # BasePrefixCache.dfs_weight_order walks `children`; handles are flat (no tree)
    children = MappingProxyType({})

    def __init__(self, ids: array, hashes: tuple[int, ...], length: int | None = None) -> None:
        self.ids, self.hashes = ids, hashes
        self.length = len(ids) if length is None else length

    @property
    def tokens(self) -> array:
        """The matched tokens (a copy: for tests and logs, not the request path)."""
        return self.ids[:self.length]


class Entry:
    """One running request's pool request and what its checkpoints handed the tree."""

    __slots__ = ("pool_id", "start", "stored", "offered")

    def __init__(self, pool_id: str) -> None:
        self.pool_id = pool_id
        self.start = 0  # the pool's hit at admission: checkpoints are planned past it only
        self.stored: dict[int, int] = {}  # block position -> hash, for blocks whose KV slots the tree owns now
        self.offered = 0  # blocks [0, offered) were committed to the pool (it stores no more there)


class PrfaasHybridCache(BasePrefixCache):
    """The full-attention index every kind keeps; not served on its own (cache.build picks a kind)."""

    def __init__(self, params, cfg: backend_config.BackendConfig) -> None:
        self.cfg, self.bs = cfg, cfg.block_size
        self.disable = False
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        # SGLang reads it for window eviction and its SWA admission budget (sliding.py sets it)
        self.sliding_window_size: int | None = None
        self.device = torch.device("cpu") if not isinstance(
            self.token_to_kv_pool_allocator.device, (str, torch.device)) else torch.device(
            self.token_to_kv_pool_allocator.device)
        self._ids = itertools.count()
        self.tiers = None  # host/storage tiers below the pool (tier_cache.attach), if the flags ask
        self.reset()

    @classmethod
    def config_for(cls, ctx, mode: str) -> backend_config.BackendConfig:
        """This kind's config from SGLang's TreeCacheBuildContext (a hybrid model's KV and Mamba pools)."""
        p = ctx.params
        return backend_config.from_server(ctx.server_args.chunked_prefill_size, p.token_to_kv_pool_allocator.size,
                                          p.req_to_token_pool.mamba_pool.size, role=mode)

    # -- lifecycle ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop the index. SGLang calls this from flush_cache with no request running, and clears its
        own allocators alongside, so the mirrored slots are forgotten, not freed."""
        pool = self.pool = HybridCachePool(PoolConfig(self.cfg.num_blocks, self.bs, self._groups(),
                                                      enable_events=True, event_token_ids=False))
        self.mirror = self._mirror(pool)
        self._full_idle = pool.idle_counter(FULL)
        self.memo = HashMemo(self.bs, pool.cfg.hash_seed)
        self._reqs: dict[int, Entry] = {}  # by req_pool_idx (unique while the row is held)
        self.root_node = Node(array("q"), ())
        if self.tiers is not None:  # a flush drops what this server cached; a shared store keeps its part
            self.tiers.clear_host()

    def _groups(self) -> tuple[GroupSpec, ...]:
        """The pool's groups, the full-attention one first (`_mirror` reads managers[0])."""
        return (GroupSpec(FULL, "full", 1, kv_bytes_per_token=1),)

    def _mirror(self, pool: HybridCachePool) -> Mirror:
        return self._mirror_over(pool, self.token_to_kv_pool_allocator.free)

    def _mirror_over(self, pool: HybridCachePool, free_kv, swa: SwaMemory | None = None) -> Mirror:
        """free_kv(slots): how a removed full entry's KV slots go back to SGLang."""
        # a cached entry holds bs of SGLang's slots of its own: at most size // bs entries
        rows = self.token_to_kv_pool_allocator.size // self.bs + 1
        return Mirror(self.bs, rows, self.device, free_kv, self._free_state, swa)

    def _free_state(self, slot) -> None:
        self.req_to_token_pool.mamba_allocator.free(slot)

    def _drain(self, insert: Insert | None = None) -> tuple[int, int, int]:
        if insert is None and self.tiers is None and not self.pool.has_events():
            return 0, 0, 0  # nothing stored or removed since the last drain: nothing to mirror or free
        counts = self._apply(insert)
        self.mirror.flush()
        if self.tiers is not None:  # what was just indexed, written through to a shared store if asked
            self.tiers.publish_stored()
        return counts

    def _apply(self, insert: Insert | None = None) -> tuple[int, int, int]:
        """Mirror the pool's events; SWA entries whose full entry went (or that memory cannot back)
        are dropped from the pool too (none outside sliding.py). Returns (KV tokens, states, window
        tokens) removed."""
        tokens, states, windows = self.mirror.apply(self._events(), insert)
        dropped = self.mirror.take_orphans() + (insert.swa_rejected if insert is not None else [])
        while dropped:
            self.pool.uncache(SWA, dropped)
            t, s, w = self.mirror.apply(self._events())
            tokens, states, windows = tokens + t, states + s, windows + w
            dropped = self.mirror.take_orphans()
        if insert is not None:
            insert.swa_rejected = []
        return tokens, states, windows

    def _events(self) -> list:
        """The pool's events since the last call; with tiers, what they remove is demoted first (its
        memory is still intact here: the mirror frees it)."""
        events = self.pool.drain_events()
        if self.tiers is not None:
            self.tiers.demote(events)
        return events

    # -- match and locks ------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        if key.is_bigram or key.extra_key is not None or key.cache_salt is not None or len(key) == 0:
            return self._result(self.root_node)  # namespaced keys are not indexed (hash seed is global)
        # the scheduler's key is the request's own array capped by key.limit: matched as it is (no
        # copy), so the request's checkpoints find that same array in the memo (no compare)
        ids, num = key.token_ids, len(key)
        # hashed up to the first block the KV index lacks: a new prompt costs one block, not its length
        seen = self.memo.get(getattr(params.req, "rid", None), ids, cached=self.mirror.kv_of.__contains__)
        k = self.pool.match(seen.tokens, seen.hashes, num_tokens=num) // self.bs
        node = Node(seen.tokens, tuple(seen.hashes[:k]), k * self.bs)
        if self.tiers is not None:  # past the device hit, from the lower tiers (loaded back now)
            node = self.tiers.extend(params, node, key.raw_token_ids())
        node = self._matched(params, node)
        return self._result(node, self._branch_point(params, seen.hashes, num, node))

    def _matched(self, params: MatchPrefixParams, node: Node) -> Node:
        """The hit this kind serves for the pool's KV match `node` (here: all of it)."""
        return node

    def _branch_point(self, params: MatchPrefixParams, hashes: list[int], num_tokens: int, node: Node) -> int | None:
        """Tokens of cached KV past the hit `node` ends at, where a state would lengthen the next
        hit (SGLang's mamba_branching_seqlen); None here (KV alone makes a hit)."""
        return None

    def _result(self, node: Node, branch: int | None = None) -> MatchResult:
        return MatchResult(device_prefix_len=node.length, last_device_node=node,
                           last_host_node=node, best_match_node=node, mamba_branching_seqlen=branch)

    def inc_lock_ref(self, node: Node) -> IncLockRefResult:
        if not node.hashes:
            return IncLockRefResult(delta=0, node_id=None)
        n = next(self._ids)
        # a pin takes no blocks, so it evicts nothing and emits no events to drain
        pinned = self.pool.pin(f"lock:{n}", list(node.hashes))
        if pinned != len(node.hashes):  # evicted between match and lock: a bug
            self.pool.free(f"lock:{n}")
            self._drain()
            raise RuntimeError(f"prfaas_hybrid: lock on {node.length} tokens found only "
                               f"{pinned * self.bs} cached")
        return IncLockRefResult(delta=0, node_id=n)

    def dec_lock_ref(self, node: Node, params=None) -> DecLockRefResult:
        if params is not None and params.node_id is not None:
            self.pool.free(f"lock:{params.node_id}")  # a pin only drops references: no event to drain
        return DecLockRefResult(delta=0)

    def path_device_indices(self, node: Node) -> torch.Tensor:
        """The hit's KV slots; a view while `node` is locked (SGLang's contract: read once, locked)."""
        return self.mirror.locked_kv_slots(node.hashes)

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        """Offer tokens [0, up_to) of the request: full blocks to the KV index, plus what the kind
        stages (`_stage`: a state, window pages).

            blocks   [0 ..... offered)[offered .......... n)      n = up_to // bs
                      committed before  the pool may store these now: one gather from the row
        Hashes come from the request's memo: only blocks no earlier call saw are hashed. On a prefill
        server the request is admitted transfer-bound: its uncached tail is transfer-cache until
        SGLang releases it after the transfer.
        """
        if req.extra_key is not None or req.cache_salt or up_to < self.bs or req.kv.req_pool_idx is None:
            return
        ids = req.full_untruncated_fill_ids
        n = min(up_to, len(ids)) // self.bs
        length = n * self.bs
        if n == 0 or self._offers_nothing(req, length, up_to):
            return
        seen = self.memo.get(req.rid, ids, blocks=n)
        hashes = seen.hashes
        mark, state = self._state_at(req, hashes[n - 1], length, up_to)
        try:
            ent = self._grow(req, seen, n, mark)
        except BaseException:
            if state is not None:
                self._free_state(state)
            raise
        self._drain()
        insert = Insert(self.req_to_token_pool.req_to_token[req.kv.req_pool_idx],
                        {hashes[i]: i for i in range(ent.offered, n)},
                        hashes[n - 1] if state is not None else None, state)
        self._stage(req, insert, hashes[n - 1], length, up_to)
        self.pool.commit(ent.pool_id, length)
        self._drain(insert)
        ent.offered = max(ent.offered, n)
        ent.stored.update((i, hashes[i]) for i in insert.stored_blocks)
        if insert.state is not None:  # not indexed (no boundary planned, or the pool had it)
            self._free_state(insert.state)

    def _offers_nothing(self, req, length: int, up_to: int) -> bool:
        """Whether a checkpoint of [0, up_to) can give the tree nothing: no state (off a block
        boundary) and every full block already offered, by an earlier checkpoint or, before the
        first, in the hit the lock pins (admitting would only pin it twice). Most releases: a
        request ending less than a block past its hit or its last chunk end."""
        if up_to == length:
            return False
        ent = self._reqs.get(req.kv.req_pool_idx)
        return length <= (ent.offered * self.bs if ent is not None else getattr(req.kv, "cache_protected_len", 0))

    def _grow(self, req, seen, n: int, mark: bool) -> Entry:
        """The request's pool request covering blocks [0, n): admitted at its first checkpoint."""
        length, hashes = n * self.bs, seen.hashes
        ent = self._reqs.get(req.kv.req_pool_idx)
        if ent is not None:
            self.pool.grow(ent.pool_id, length, seen.tokens, hashes, state_at_end=mark)
            return ent
        ent = self._reqs[req.kv.req_pool_idx] = Entry(f"req:{next(self._ids)}")
        # one token past `length`, so the pool may count all of it as a hit (a lock's blocks)
        ent.start = self.pool.admit(ent.pool_id, seen.tokens[:length] + _ONE_TOKEN, num_tokens=length,
                                    hashes=hashes[:n], transfer=self.cfg.role == "prefill",
                                    state_at_end=mark).num_cached_tokens
        ent.offered = ent.start // self.bs
        return ent

    def _state_at(self, req, last_hash: int, length: int, up_to: int) -> tuple[bool, object]:
        """(mark, state): whether the pool checkpoints a state at `length` (the kind will hold one
        there), and a fresh slot holding it if the pool has none yet (here: no states)."""
        return False, None

    def _stage(self, req, insert: Insert, last_hash: int, length: int, up_to: int) -> None:
        """Add to `insert` what this kind offers besides the KV blocks of [0, length) and its state
        (here: nothing)."""

    def free_kv_row(self, kv, ranges: list[tuple[int, int]]) -> None:
        """Free row ranges except the blocks this request handed to the tree; the pieces left go
        back to the allocator in one free, not one per piece (row_free.py)."""
        ent = self._reqs.get(kv.req_pool_idx)
        if ent is not None and ent.stored:
            self._free_windows(kv, ent, ranges)
            ranges = row_free.outside(ranges, ent.stored, self.bs)
        row_free.free(self, kv, ranges, super().free_kv_row)

    def _free_windows(self, kv, ent: Entry, ranges: list[tuple[int, int]]) -> None:
        """Free what the row holds beside the KV of the blocks the tree took (here: nothing)."""

    def on_release(self, req, *, checkpointed: bool) -> None:
        ent = self._reqs.pop(req.kv.req_pool_idx, None) if req.kv.req_pool_idx is not None else None
        if ent is not None:
            self.pool.free(ent.pool_id)
            self._drain()
        self.memo.drop(req.rid)
        if req.kv.holds_mamba:  # the tree keeps copies, never the request's own slot
            self.req_to_token_pool.free_mamba_cache(req)
        if self.cfg.check_integrity:
            self.check_integrity()

    def check_integrity(self) -> None:
        """Pool invariants + the mirror equals the index; logs one line, raises AssertionError."""
        self.pool.check_integrity()
        self.mirror.check(self.pool)
        u = self.pool.usage()
        log.info("prfaas_hybrid integrity ok: %d KV blocks, %d states cached, %d pool requests, "
                 "%d transfer-cache blocks", len(self.mirror.kv_of), len(self.mirror.state_of),
                 len(self.pool.request_ids()), u.transfer)

    # -- eviction and sizes ---------------------------------------------------------------------
    def evict(self, params: EvictParams) -> EvictResult:
        """Evict LRU entries until enough is freed; their slots go back in one free per allocator."""
        slab = getattr(self.token_to_kv_pool_allocator, "slab_blocks", None)
        met = self._shortfall_met(params, slab)
        tokens = states = windows = 0
        while not (met(tokens, states) and windows >= params.swa_num_tokens):
            group = self._evict_group(tokens < params.num_tokens, windows < params.swa_num_tokens)
            if not (self.pool.evict_lru(group) or (group is not None and self.pool.evict_lru())):
                break
            t, s, w = self._apply()
            tokens, states, windows = tokens + t, states + s, windows + w
            if slab is not None:
                self.mirror.flush()
        self.mirror.flush()
        return EvictResult(num_tokens_evicted=tokens, swa_num_tokens_evicted=windows, mamba_num_evicted=states)

    def _evict_group(self, short_kv: bool, short_windows: bool) -> str | None:
        """The pool group to evict from first; None: the least recently used entry of any group."""
        return None

    def _shortfall_met(self, params: EvictParams, slab):
        """(tokens, states evicted so far) -> done? Over one slab (--prfaas-unified-pool) an entry of
        either kind may free the block the other kind needs, so the allocators are asked instead (the
        loop flushes after each eviction for that)."""
        if slab is None:
            return lambda tokens, states: tokens >= params.num_tokens and states >= params.mamba_num
        kv = self.token_to_kv_pool_allocator
        kv_want, state_want = kv.available_size() + params.num_tokens, slab.state_available() + params.mamba_num
        return lambda tokens, states: kv.available_size() >= kv_want and slab.state_available() >= state_want

    # SGLang reads these several times per scheduler step: each is O(1) (the pool keeps per-group
    # idle counters; a linear state is one pool block, see linear.py)
    def evictable_size(self) -> int:
        return self._full_idle() * self.bs

    full_evictable_size = evictable_size

    def protected_size(self) -> int:
        return (len(self.mirror.kv_of) - self._full_idle()) * self.bs

    full_protected_size = protected_size

    def swa_evictable_size(self) -> int:
        return 0

    def swa_protected_size(self) -> int:
        return len(self.mirror.swa_of) * self.bs - self.swa_evictable_size()

    def mamba_evictable_size(self) -> int:
        return 0

    def mamba_protected_size(self) -> int:
        return len(self.mirror.state_of) - self.mamba_evictable_size()

    def total_size(self) -> int:
        return len(self.mirror.kv_of) * self.bs

    def all_values_flatten(self) -> torch.Tensor:
        return self.mirror.kv_slots(list(self.mirror.kv_of))

    def all_mamba_values_flatten(self) -> torch.Tensor:
        vals = list(self.mirror.state_of.values())
        return torch.cat(vals) if vals else torch.empty((0,), dtype=torch.int64)

    def supports_mamba(self) -> bool:
        return True

    def supports_swa(self) -> bool:
        return False

    def pretty_print(self) -> None:
        print(f"prfaas_hybrid: {self.total_size()} tokens, {len(self.mirror.state_of)} states cached")
