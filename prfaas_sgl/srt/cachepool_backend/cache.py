"""PrfaasHybridCache: SGLang's BasePrefixCache for hybrid linear-attention models, backed by HybridCachePool.

A state is one SGLang Mamba-pool slot, copied whole (`MambaPool.copy_from`: every conv tensor and the
recurrent one), so the family's shapes never reach this module: GDN's conv (dim, K-1), KDA's transposed
(K-1, 3 H D) and Lightning's recurrent-only state are cached and restored alike
(tests/fast/test_cachepool_backend_states.py).

Ownership of a running request's KV row (page size 1, block size bs):

    row positions  [0, protected)        tree's slots, matched at admission, pinned by req.lock
                   [protected, up_to)    the request's own slots; at each checkpoint the blocks
                                         whose hash is new are handed to the tree (`stored`), the
                                         rest stay private (duplicates) and are freed at release

Each SGLang request is one pool request (`admit` at its first checkpoint, `grow`+`commit` at each
later one, `free` at release), so the pool's references pin exactly what the row reads. A lock on a
match handle is a pool request of its own over the matched tokens. Mamba states: a checkpoint copies
the request's slot into a fresh slot (as SGLang's MambaComponent does for no_buffer); a hit sets
`mamba_cow_src_index`, and the scheduler copies it into the request's slot before the forward.

PD roles (--disaggregation-mode): a prefill server matches and checkpoints as colocated, and admits
each request as transfer-bound (its uncached tail is transfer-cache until SGLang releases the request
after the transfer). A decode server (with --disaggregation-decode-enable-radix-cache) indexes
full-attention KV only: its hit becomes SGLang's decode_prefix_len, the prefill sends the pages past
it plus the prompt-end state, so decode never needs a cached state and any block-aligned prefix counts.

Sliding-window hybrids (SWA + full attention, no linear layers; colocated only): a full group and an
SWA group (window = sliding_window_size + 1) instead of the linear one; a hit is any block boundary
whose window pages survive (swa.py, docs/cachepool-swa.md). A checkpoint raises the request's
swa_evict_floor over what it hands the tree, so SGLang's window eviction never frees tree-owned pages.
"""
from __future__ import annotations

import itertools
import logging
from array import array
from dataclasses import dataclass, field

import torch
from sglang.srt.mem_cache.base_prefix_cache import (BasePrefixCache, DecLockRefResult, EvictParams,
                                                    EvictResult, IncLockRefResult, MatchPrefixParams,
                                                    MatchResult)
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from prfaas_sgl.cachepool import GroupSpec, HybridCachePool, PoolConfig

from . import config as backend_config
from .hashes import HashMemo
from .mirror import FULL, LINEAR, Insert, Mirror
from .swa import SWA, SwaMemory

log = logging.getLogger(__name__)


_ONE_TOKEN = array("q", [0])  # see inc_lock_ref


@dataclass(frozen=True, slots=True, eq=False)
class Node:
    """A match handle: the matched tokens and their block hashes (len(tokens) == bs * len(hashes)).
    Compared by identity: its tokens are an array (a copy of an array slice is a memcpy, a tuple of
    128K ints is not)."""

    tokens: array
    hashes: tuple[int, ...]
    # BasePrefixCache.dfs_weight_order walks `children`; handles are flat (no tree)
    children: dict = field(default_factory=dict, compare=False, hash=False)


class _Entry:
    __slots__ = ("pool_id", "start", "stored", "first_gap", "checked", "offered")

    def __init__(self, pool_id: str) -> None:
        self.pool_id = pool_id
        self.start = 0  # the pool's hit at admission: checkpoints are planned past it only
        self.stored: dict[int, int] = {}  # block position -> hash, for blocks whose KV slots the tree owns now
        self.first_gap = 0  # first grid boundary with no state: nothing at or past it is committed
        self.checked = 0  # grid boundaries <= checked (tokens) had a state and were committed
        self.offered = 0  # blocks [0, offered) were committed to the pool (it stores no more there)


def build(ctx) -> "PrfaasHybridCache":
    """Factory for SGLang's registry (TreeCacheBuildContext -> cache); rejects what it cannot serve."""
    p, sa = ctx.params, ctx.server_args
    mode = getattr(sa, "disaggregation_mode", "null") or "null"
    swa = ctx.is_hybrid_swa
    problems = [msg for bad, msg in (
        (not (ctx.is_hybrid_ssm or swa), "serves hybrid linear-attention (Mamba/GDN/KDA/Lightning) and "
                                         "sliding-window hybrid models only; omit --radix-cache-backend"),
        (ctx.is_hybrid_ssm and swa, "does not handle a model with both sliding-window and linear-attention "
                                    "layers yet (docs/cachepool-swa.md)"),
        (swa and mode != "null", f"serves sliding-window models colocated only, not as a {mode} server yet "
                                 "(docs/cachepool-swa.md, step 7); omit --radix-cache-backend there"),
        (swa and getattr(ctx, "full_tokens_per_layer", None) == 0,
         "needs full-attention layers (an all-sliding-window model has no prefix to index)"),
        (swa and not getattr(p, "sliding_window_size", None), "needs the model's sliding_window_size "
                                                             "(SGLang found none)"),
        (p.page_size != 1, f"needs --page-size 1, got {p.page_size}"),
        (ctx.enable_hierarchical_cache, "does not support --enable-hierarchical-cache"),
        # no_buffer also means no overlap scheduler (sglang/srt/arg_groups/mamba_hook.py:157-160
        # asserts --disable-overlap-schedule), and SGLang's extra_buffer needs a CUDA/MUSA/NPU/HIP/XPU
        # platform (mamba_hook.py:102-121): a hybrid model on CPU never runs the overlap scheduler
        (getattr(p, "enable_mamba_extra_buffer", False), "needs --mamba-radix-cache-strategy no_buffer"),
        (ctx.disable_radix_cache and mode == "decode",
         "on a decode server needs --disaggregation-decode-enable-radix-cache (SGLang turns prefix "
         "caching off on decode servers otherwise)"),
        (ctx.disable_radix_cache and mode != "decode", "conflicts with --disable-radix-cache"),
    ) if bad]
    if problems:
        raise ValueError("--radix-cache-backend prfaas_hybrid: " + "; ".join(problems))
    if swa:
        alloc = p.token_to_kv_pool_allocator
        cfg = backend_config.from_server(sa.chunked_prefill_size, alloc.size_full + alloc.size_swa, 0,
                                         role=mode, swa_window=p.sliding_window_size + 1)
    else:
        cfg = backend_config.from_server(sa.chunked_prefill_size, p.token_to_kv_pool_allocator.size,
                                         p.req_to_token_pool.mamba_pool.size, role=mode)
    return PrfaasHybridCache(p, cfg)


class PrfaasHybridCache(BasePrefixCache):
    def __init__(self, params, cfg: backend_config.BackendConfig) -> None:
        self.cfg, self.bs = cfg, cfg.block_size
        # A decode server never resumes a state from its cache: the prefill sends the request's state
        # at the prompt end whatever prefix decode holds, and only the full-attention pages past
        # that prefix. So decode indexes KV alone and a hit is any block-aligned prefix (the hybrid
        # rule would cap it at a state checkpoint decode never has).
        self.kv_only = cfg.role == "decode"
        self.swa = cfg.swa_window > 0
        self.states = not (self.kv_only or self.swa)  # a linear group: state checkpoints and copies
        self.disable = False
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        # SGLang reads it for window eviction and its SWA admission budget
        self.sliding_window_size = cfg.swa_window - 1 if self.swa else None
        self.device = torch.device("cpu") if not isinstance(
            self.token_to_kv_pool_allocator.device, (str, torch.device)) else torch.device(
            self.token_to_kv_pool_allocator.device)
        self._ids = itertools.count()
        self.reset()

    # -- lifecycle ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop the index. SGLang calls this from flush_cache with no request running, and clears its
        own allocators alongside, so the mirrored slots are forgotten, not freed."""
        groups = (GroupSpec(FULL, "full", 1, kv_bytes_per_token=1),)
        if self.states:
            groups += (GroupSpec(LINEAR, "linear", 1, state_bytes=self.bs,  # one block per state
                                 checkpoint_interval=self.cfg.checkpoint_interval),)
        if self.swa:
            groups += (GroupSpec(SWA, "swa", 1, kv_bytes_per_token=1, window=self.cfg.swa_window),)
        pool = self.pool = HybridCachePool(PoolConfig(self.cfg.num_blocks, self.bs, groups, enable_events=True))
        allocator = self.token_to_kv_pool_allocator
        swa = SwaMemory(allocator) if self.swa else None
        # block_of reads the full group's index (hash -> block) directly: a lookup per stored block
        self.mirror = Mirror(self.bs, self.cfg.num_blocks, self.device, pool.managers[0].index.__getitem__,
                             swa.free_full if swa else allocator.free, self._free_state, swa)
        self.memo = HashMemo(self.bs, pool.cfg.hash_seed)
        self._reqs: dict[int, _Entry] = {}  # by req_pool_idx (unique while the row is held)
        self.root_node = Node(array("q"), ())

    def _free_state(self, slot) -> None:
        self.req_to_token_pool.mamba_allocator.free(slot)

    def _drain(self, insert: Insert | None = None) -> tuple[int, int, int]:
        counts = self._apply(insert)
        self.mirror.flush()
        return counts

    def _apply(self, insert: Insert | None = None) -> tuple[int, int, int]:
        """Mirror the pool's events; SWA entries whose full entry went (or that memory cannot back)
        are dropped from the pool too. Returns (KV tokens, states, window tokens) removed."""
        tokens, states, windows = self.mirror.apply(self.pool.drain_events(), insert)
        dropped = self.mirror.take_orphans() + (insert.swa_rejected if insert is not None else [])
        while dropped:
            self.pool.uncache(SWA, dropped)
            t, s, w = self.mirror.apply(self.pool.drain_events())
            tokens, states, windows = tokens + t, states + s, windows + w
            dropped = self.mirror.take_orphans()
        if insert is not None:
            insert.swa_rejected = []
        return tokens, states, windows

    # -- match and locks ------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        if key.is_bigram or key.extra_key is not None or key.cache_salt is not None or len(key) == 0:
            return self._result(self.root_node)  # namespaced keys are not indexed (hash seed is global)
        req = params.req
        ids = key.raw_token_ids()
        seen = self.memo.get(getattr(req, "rid", None), ids)  # covers ids, maybe more of the request
        k = self.pool.match(ids, seen.hashes) // self.bs
        node = Node(seen.tokens[:k * self.bs], tuple(seen.hashes[:k]))
        if not self.states:
            return self._result(node)
        if k and params.cow_mamba and req is not None and not self._cow(req, node):
            node = self.root_node
        if not node.hashes and params.cow_mamba and req is not None and req.kv.mamba_cow_src_index is not None:
            req.kv.mamba_cow_src_index = None  # an earlier match staged a copy this miss must not run
            req.kv.mamba_needs_clear = True
        return self._result(node)

    def _result(self, node: Node) -> MatchResult:
        return MatchResult(device_prefix_len=len(node.tokens), last_device_node=node,
                           last_host_node=node, best_match_node=node)

    def _cow(self, req, node: Node) -> bool:
        """Stage the copy of the checkpoint at the match end into the request's state slot."""
        if not req.kv.holds_mamba:
            slot = self._alloc_state(pin=node)
            if slot is None:
                return False
            req.kv.mamba_pool_idx = slot[0]
        req.kv.mamba_cow_src_index = self.mirror.state_of[node.hashes[-1]]
        req.kv.mamba_needs_clear = False
        return True

    def _alloc_state(self, pin: Node | None = None):
        """A free Mamba slot, evicting LRU entries (never `pin`'s) if needed; None if none can be freed."""
        alloc = self.req_to_token_pool.mamba_allocator
        slot = alloc.alloc(1)
        if slot is None:
            receipt = self.inc_lock_ref(pin) if pin is not None else None
            self.evict(EvictParams(mamba_num=1))
            slot = alloc.alloc(1)
            if receipt is not None:
                self.dec_lock_ref(pin, receipt.to_dec_params())
        return slot

    def inc_lock_ref(self, node: Node) -> IncLockRefResult:
        if not node.hashes:
            return IncLockRefResult(delta=0, node_id=None)
        n = next(self._ids)
        # one token past the match, so the pool may count every matched token as a hit
        alloc = self.pool.admit(f"lock:{n}", node.tokens + _ONE_TOKEN, num_tokens=len(node.tokens),
                                hashes=list(node.hashes))
        self._drain()
        if alloc.num_cached_tokens != len(node.tokens):  # evicted between match and lock: a bug
            self.pool.free(f"lock:{n}")
            self._drain()
            raise RuntimeError(f"prfaas_hybrid: lock on {len(node.tokens)} tokens found only "
                               f"{alloc.num_cached_tokens} cached")
        return IncLockRefResult(delta=0, node_id=n)

    def dec_lock_ref(self, node: Node, params=None) -> DecLockRefResult:
        if params is not None and params.node_id is not None:
            self.pool.free(f"lock:{params.node_id}")
            self._drain()
        return DecLockRefResult(delta=0)

    def path_device_indices(self, node: Node) -> torch.Tensor:
        return self.mirror.kv_slots(node.hashes)

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        """Offer tokens [0, up_to) of the request: full blocks to the KV index, and the request's
        state if up_to is a checkpoint boundary (its state slot holds exactly that state).

            blocks   [0 ..... offered)[offered .......... n)      n = up_to // bs
                      committed before  the pool may store these now: one gather from the row
        Hashes come from the request's memo: only blocks no earlier call saw are hashed.
        """
        if req.extra_key is not None or req.cache_salt or up_to < self.bs or req.kv.req_pool_idx is None:
            return
        ids = req.full_untruncated_fill_ids
        n = min(up_to, len(ids)) // self.bs
        length = n * self.bs
        if n == 0:
            return
        seen = self.memo.get(req.rid, ids)
        ent = self._reqs.get(req.kv.req_pool_idx)
        if ent is None:
            ent = self._reqs[req.kv.req_pool_idx] = _Entry(f"req:{next(self._ids)}")
            # one token past `length`, so the pool may count all of it as a hit (a lock's blocks)
            ent.start = self.pool.admit(ent.pool_id, seen.tokens[:length] + _ONE_TOKEN, num_tokens=length,
                                        hashes=seen.hashes[:n], transfer=self.cfg.role == "prefill").num_cached_tokens
            ent.offered = ent.start // self.bs
        else:
            self.pool.grow(ent.pool_id, length, seen.tokens, seen.hashes)
        self._drain()
        hashes = seen.hashes
        insert = Insert(self.req_to_token_pool.req_to_token[req.kv.req_pool_idx],
                        {hashes[i]: i for i in range(ent.offered, n)})
        on_grid = length == up_to and up_to % self.cfg.checkpoint_interval == 0
        if self.states and on_grid and hashes[n - 1] not in self.mirror.state_of:
            insert.state_hash, insert.state = hashes[n - 1], self._snapshot(req)
        if self.swa:
            insert.swa_limit = self._protect_windows(req, length)
        point = self._commit_point(ent, hashes, length, insert)
        self.pool.commit(ent.pool_id, point)
        self._drain(insert)
        ent.offered = max(ent.offered, point // self.bs)
        ent.stored.update((i, hashes[i]) for i in insert.stored_blocks)
        if insert.state is not None:  # not indexed (no boundary planned, or the pool had it)
            self._free_state(insert.state)

    def _protect_windows(self, req, length: int) -> int:
        """Row positions below which this checkpoint may give the tree window pages. SGLang's window
        eviction frees the row's [swa_dead_lo, cursor); raising swa_evict_floor over [0, length)
        keeps it off pages the tree takes, but only while it has freed nothing there (the floor also
        decides which part release frees full-side only). A finished request frees nothing more."""
        kv = req.kv
        if req.finished():
            return length
        dead_lo = kv.swa_dead_lo(self.page_size)
        if kv.get_evicted_seqlen(ComponentType.SWA) <= dead_lo:
            kv.swa_evict_floor = max(kv.swa_evict_floor, length)
            return length
        return dead_lo

    def _snapshot(self, req):
        """Copy the request's state into a fresh slot; None if no slot can be freed."""
        slot = self._alloc_state()
        if slot is not None:
            pool = self.req_to_token_pool
            src = pool.translate_mamba_indices(req.kv.mamba_pool_idx.unsqueeze(0))
            pool.mamba_pool.copy_from(src, pool.translate_mamba_indices(slot))
        return slot

    def _commit_point(self, ent: _Entry, hashes: list[int], length: int, insert: Insert) -> int:
        """Tokens to commit. The pool plans a checkpoint at every grid boundary a request crosses,
        but SGLang holds a state only at chunk ends: commit stops before the first boundary with
        neither a state from this checkpoint nor an indexed one (it would index a wrong state).
        Boundaries up to ent.checked were committed by an earlier call, so each is checked once.

            grid   |----c----|----c----|----c----|
            chunks [  chunk  )[ short )[  chunk   )   <- the second boundary has no state: stop
        """
        c, bs = self.cfg.checkpoint_interval, self.bs
        if not self.states:
            return length
        if not ent.first_gap:
            for b in range((max(ent.start, ent.checked) // c + 1) * c, length + 1, c):
                h = hashes[b // bs - 1]
                if not (h in self.mirror.state_of or (h == insert.state_hash and insert.state is not None)):
                    ent.first_gap = b
                    break
            else:
                ent.checked = max(ent.checked, length)
        return min(length, ent.first_gap - 1) if ent.first_gap else length

    def free_kv_row(self, kv, ranges: list[tuple[int, int]]) -> None:
        """Free row ranges except the blocks this request handed to the tree; the pieces left go
        back to the allocator in one free (SGLang's free group), not one per piece."""
        ent = self._reqs.get(kv.req_pool_idx)
        if ent is None or not ent.stored:
            return super().free_kv_row(kv, ranges)
        if self.swa:
            self._free_untaken_windows(kv, ent, ranges)
        pieces = []
        for start, end in ranges:
            pos = start
            for i in sorted(b for b in ent.stored if start < (b + 1) * self.bs and b * self.bs < end):
                if pos < i * self.bs:
                    pieces.append((pos, i * self.bs))
                pos = max(pos, (i + 1) * self.bs)
            if pos < end:
                pieces.append((pos, end))
        allocator = self.token_to_kv_pool_allocator
        if len(pieces) < 2 or getattr(allocator, "free_group", False) is not None:
            if pieces:  # one piece, or a free group the caller already opened collects them
                super().free_kv_row(kv, pieces)
            return
        allocator.free_group_begin()
        try:
            super().free_kv_row(kv, pieces)
        finally:
            allocator.free_group_end()

    def _free_untaken_windows(self, kv, ent: _Entry, ranges: list[tuple[int, int]]) -> None:
        """free_kv_row skips the blocks the tree took, but the tree owns their window pages only
        while its SWA index holds them: the live pages of the others are still the request's."""
        bs = self.bs
        mine = [i for i, h in ent.stored.items() if h not in self.mirror.swa_of
                and any(s < (i + 1) * bs and i * bs < e for s, e in ranges)]
        if mine:
            row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
            pos = torch.tensor(mine, dtype=torch.int64, device=row.device)
            slots = row[(torch.arange(bs, device=row.device) + pos[:, None] * bs).reshape(-1)].to(torch.int64)
            self.mirror.swa.free_window(slots[self.mirror.swa.alive(slots)])

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
        """An SWA model short of window pages only evicts SWA entries first (they serve only hits no
        longer than theirs); short of KV, full entries (their window pages go with them)."""
        if not self.swa:
            return None
        return FULL if short_kv else SWA if short_windows else None

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
    # idle counters; a linear state is one pool block here, see reset())
    def evictable_size(self) -> int:
        return self.pool.idle_blocks(FULL) * self.bs

    full_evictable_size = evictable_size

    def protected_size(self) -> int:
        return len(self.mirror.kv_of) * self.bs - self.evictable_size()

    full_protected_size = protected_size

    def swa_evictable_size(self) -> int:
        return self.pool.idle_blocks(SWA) * self.bs if self.swa else 0

    def swa_protected_size(self) -> int:
        return len(self.mirror.swa_of) * self.bs - self.swa_evictable_size()

    def mamba_evictable_size(self) -> int:
        return self.pool.idle_blocks(LINEAR) if self.states else 0

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
        return not self.swa

    def supports_swa(self) -> bool:
        return self.swa

    def pretty_print(self) -> None:
        print(f"prfaas_hybrid: {self.total_size()} tokens, {len(self.mirror.state_of)} states cached")
