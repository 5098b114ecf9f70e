"""HybridCachePool: one shared BlockPool, one manager per layer group, one prefix lookup for all.

Request lifecycle (the scheduler's thread only):
    admit(req, tokens, num_tokens)  -> Allocation   match the longest hybrid hit, reference it, add
                                                    blocks for tokens [0, num_tokens)
    grow(req, num_tokens, tokens)   -> Allocation   next prefill chunk or decode tokens
        state_at_end=True on either: the caller will hold the request's linear state at exactly
        num_tokens, so it is checkpointed there too (off the grid: a prompt's end, a branch point)
    commit(req, num_computed)                       tokens [0, num_computed) are in the blocks:
                                                    cache full blocks / due checkpoints
    free(req)                                       request done, or its transfer completed
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Optional

from .allocation import Allocation, PoolUsage
from .block_pool import BlockPool
from .config import PoolConfig
from .events import AnyEvent, EventLog
from .hashing import block_hashes, extend_hashes
from .integrity import check_pool
from .managers import manager_class
from .specs import PoolExhaustedError, RequestTooLongError


class _Request:
    __slots__ = ("req_id", "token_ids", "hashes", "states", "num_tokens", "transfer")

    def __init__(self, req_id: str, token_ids: list[int], hashes: list[int], states: list[Any],
                 transfer: bool) -> None:
        self.req_id = req_id
        self.token_ids = token_ids
        self.hashes = hashes
        self.states = states
        self.num_tokens = 0
        self.transfer = transfer


class HybridCachePool:
    def __init__(self, cfg: PoolConfig) -> None:
        self.cfg = cfg
        self.blocks = BlockPool(cfg.num_blocks)
        self.events = EventLog(cfg.enable_events, cfg.event_token_ids)
        self.managers = tuple(
            manager_class(g.kind)(g, cfg, self.blocks, self.events) for g in cfg.groups)
        self._by_name = {m.name: m for m in self.managers}
        self._reqs: dict[str, _Request] = {}
        self._pins: dict[str, list[list[int]]] = {}  # pin id -> per group, the blocks it references

    # -- lookup --------------------------------------------------------------------------------
    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        return block_hashes(token_ids, self.cfg.block_size, self.cfg.hash_seed)

    def match(self, token_ids: Sequence[int], hashes: Optional[list[int]] = None,
              num_tokens: Optional[int] = None) -> int:
        """Tokens of the longest prefix EVERY group can resume from (read-only, no recency touch).
        At least one token is always left to compute (its logits are needed). num_tokens: match
        token_ids[:num_tokens] only (a capped key, without copying the list)."""
        hashes = self.hashes(token_ids) if hashes is None else hashes
        n = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
        return self._hit_blocks(hashes, n) * self.cfg.block_size

    def _hit_blocks(self, hashes: list[int], num_tokens: int) -> int:
        """Fixpoint of min over groups: a group may only lower k, so k decreases until all agree
        (e.g. full KV has 40 blocks, the last linear checkpoint is at 32, SWA misses block 30)."""
        k = min(len(hashes), max(0, num_tokens - 1) // self.cfg.block_size)
        while True:
            k_next = k
            for m in self.managers:
                k_next = m.longest_hit(hashes, k_next)
            if k_next == k:
                return k
            k = k_next

    # -- lifecycle -----------------------------------------------------------------------------
    def admit(self, req_id: str, token_ids: Sequence[int], num_tokens: Optional[int] = None,
              transfer: bool = False, hashes: Optional[list[int]] = None,
              state_at_end: bool = False) -> Allocation:
        """Match, reference the hit, and allocate for tokens [0, num_tokens) (default: all).

        transfer: the prefill's KV goes to another cluster; its uncached blocks are transfer-cache
        blocks, released by free() once the transfer completes.
        hashes: self.hashes(token_ids) if the caller already has them; the pool then keeps both
        token_ids and hashes without copying.
        state_at_end: checkpoint linear states at num_tokens (a multiple of block_size) too.
        Raises RequestTooLongError (never fits; nothing changed), PoolExhaustedError (retry later;
        nothing changed except the hit's LRU recency), ValueError (duplicate id).
        """
        if req_id in self._reqs or req_id in self._pins:
            raise ValueError(f"request {req_id!r} is already admitted; free() it first")
        if hashes is None:  # else the caller keeps both lists and only appends to them (see grow)
            token_ids = list(token_ids)
        self._check_fits(req_id, len(token_ids))
        hashes = self.hashes(token_ids) if hashes is None else hashes
        k = self._hit_blocks(hashes, len(token_ids))
        req = _Request(req_id, token_ids, hashes, [m.new_state() for m in self.managers], transfer)
        for m, st in zip(self.managers, req.states):
            m.acquire_hit(st, hashes, k)
        req.num_tokens = k * self.cfg.block_size
        try:
            alloc = self._grow(req, len(token_ids) if num_tokens is None else num_tokens, k, state_at_end)
        except PoolExhaustedError:
            self._release(req)
            raise
        self._reqs[req_id] = req
        return alloc

    def pin(self, req_id: str, hashes: list[int]) -> int:
        """Reference what a hit of the blocks `hashes` names needs in every group, and nothing else: a
        lock on a match (no blocks allocated, nothing to commit). Returns the blocks pinned, fewer than
        len(hashes) if some were evicted since the match. free(req_id) releases them; the request
        cannot grow. Raises ValueError (duplicate id). A pin is its blocks only (no request state:
        SGLang locks every match it runs, so this is on each request's path)."""
        if req_id in self._reqs or req_id in self._pins:
            raise ValueError(f"request {req_id!r} is already admitted; free() it first")
        k = len(hashes)
        try:  # nothing evicted since the match (the usual case): every group's hit reads its k blocks
            held = [m.hit_blocks(hashes, k) for m in self.managers]
        except KeyError:  # a group lacks one of them: the hit every group still has, as a match finds it
            k = self._hit_blocks(hashes, k * self.cfg.block_size + 1)
            held = [m.hit_blocks(hashes, k) for m in self.managers]
        self._pins[req_id] = held
        for blocks in held:
            self.blocks.incref(blocks)
        return k

    def grow(self, req_id: str, num_tokens: int, token_ids: Optional[Sequence[int]] = None,
             hashes: Optional[list[int]] = None, state_at_end: bool = False) -> Allocation:
        """Cover tokens [0, num_tokens). token_ids: the request's full token list if it grew
        (decode); only blocks not hashed yet are hashed, chained from the last known hash.
        hashes: block_hashes(token_ids) if the caller keeps them incrementally; the pool then keeps
        both lists without copying, and the caller may only append to them.
        state_at_end: checkpoint linear states at num_tokens (a multiple of block_size) too.
        Raises PoolExhaustedError with nothing changed (the lists are the same tokens either way)."""
        req = self._reqs[req_id]
        if token_ids is not None and hashes is not None:
            req.token_ids, req.hashes = token_ids, hashes  # type: ignore[assignment]
        elif token_ids is not None and len(token_ids) > len(req.token_ids):
            req.token_ids = list(token_ids)
            extend_hashes(req.hashes, req.token_ids, self.cfg.block_size, self.cfg.hash_seed)
        return self._grow(req, num_tokens, None, state_at_end)

    def _grow(self, req: _Request, num_tokens: int, hit_blocks: Optional[int], state_at_end: bool) -> Allocation:
        if num_tokens > len(req.token_ids):
            raise ValueError(f"num_tokens={num_tokens} > {len(req.token_ids)} known tokens of "
                             f"{req.req_id!r}; pass token_ids to grow()")
        if state_at_end and num_tokens % self.cfg.block_size:
            raise ValueError(f"state_at_end at {num_tokens} tokens: not a multiple of block_size="
                             f"{self.cfg.block_size} (a state is reusable only at a block boundary)")
        for m, st in zip(self.managers, req.states):  # set or cleared on every grow: a refused
            m.mark_state(st, num_tokens if state_at_end else 0)  # grow leaves no mark behind
        needs = [m.blocks_to_grow(st, num_tokens) for m, st in zip(self.managers, req.states)]
        fresh = self.blocks.take(sum(needs))  # all or nothing
        out, pos = [], 0
        for m, st, n in zip(self.managers, req.states, needs):
            out.append(m.grow(st, num_tokens, fresh[pos:pos + n]))
            pos += n
        req.num_tokens = max(req.num_tokens, num_tokens)
        cached = (hit_blocks or 0) * self.cfg.block_size
        return Allocation(req.req_id, cached, req.num_tokens, tuple(out))

    def commit(self, req_id: str, num_computed: int) -> None:
        """Tokens [0, num_computed) are written: cache what became reusable. Emits events."""
        req = self._reqs[req_id]
        num_computed = min(num_computed, req.num_tokens)
        for m, st in zip(self.managers, req.states):
            m.commit(st, req.hashes, req.token_ids, num_computed)

    def free(self, req_id: str) -> None:
        """Release a finished request (or a transfer-bound prefill whose transfer completed):
        cached blocks become evictable, everything else returns to the free list."""
        held = self._pins.pop(req_id, None)
        if held is None:
            self._release(self._reqs.pop(req_id))
            return
        for blocks in reversed(held):  # as _release: the last group first, tails first
            self.blocks.decref(blocks)

    def evict_lru(self, group: Optional[str] = None) -> bool:
        """Evict the least recently released cached entry (of `group` if given); False if none is
        evictable. Emits BlockRemoved. For a caller whose memory the index mirrors (an SGLang tree
        backend)."""
        return self.blocks.evict_one(None if group is None else self._by_name[group])

    def uncache(self, group: str, hashes: Sequence[int]) -> None:
        """Drop `group`'s entries for these hashes (those it holds), referenced or not; a request
        holding one keeps the block as its own. Emits BlockRemoved. For a caller that cannot back
        an entry the pool stored, or that drops entries no hit can reach any more."""
        m = self._by_name[group]
        for h in hashes:
            if h in m.index:
                self.blocks.uncache(m, h)

    def _release(self, req: _Request) -> None:
        for m, st in zip(reversed(self.managers), reversed(req.states)):
            m.release(st)

    def _check_fits(self, req_id: str, n: int) -> None:
        peak = sum(m.peak_blocks(n) for m in self.managers)
        if peak > self.cfg.num_blocks:
            raise RequestTooLongError(
                f"request {req_id!r}: {n} tokens need {peak} blocks but the pool has only "
                f"{self.cfg.num_blocks}; shorten the request or give the pool more blocks")

    # -- introspection -------------------------------------------------------------------------
    def drain_events(self) -> list[AnyEvent]:
        return self.events.drain()

    def has_events(self) -> bool:
        """Events buffered since the last drain (a caller with nothing to mirror skips the drain)."""
        return self.events.pending()

    def usage(self) -> PoolUsage:
        bp = self.blocks
        free, idle = bp.num_free(), bp.num_cached_idle()
        transfer = {b for r in self._reqs.values() if r.transfer
                    for m, st in zip(self.managers, r.states) for b in m.held_blocks(st)
                    if bp.owner[b] is None}
        return PoolUsage(bp.num_blocks, free, idle, bp.num_blocks - free - idle, len(transfer))

    def idle_counter(self, group: str) -> Callable[[], int]:
        """idle_blocks(group) as a callable with no Python frame of its own (a bound dict.get): the
        SGLang backend's size queries run several times per scheduler step."""
        return partial(self.blocks.idle_counts().get, self._by_name[group], 0)

    def idle_blocks(self, group: str) -> int:
        """Cached blocks of `group` that no request references (evictable now). O(1): read on every
        scheduler step by the SGLang backend."""
        return self.blocks.num_idle(self._by_name[group])

    def request_ids(self) -> list[str]:
        return list(self._reqs) + list(self._pins)

    def held(self, req_id: str) -> list[list[int]]:
        """Per group, the blocks the request references (for tests and the storage layer)."""
        if req_id in self._pins:
            return [list(blocks) for blocks in self._pins[req_id]]
        req = self._reqs[req_id]
        return [m.held_blocks(st) for m, st in zip(self.managers, req.states)]

    def reset(self) -> None:
        """Drop the whole cache; only legal with no admitted requests. Emits AllBlocksCleared."""
        if self._reqs or self._pins:
            raise RuntimeError(f"reset() with {len(self._reqs) + len(self._pins)} requests admitted; free them first")
        for m in self.managers:
            m.clear_index()
        self.blocks.reset()
        if self.events.enabled:
            self.events.cleared()

    def check_integrity(self) -> None:
        """Raise AssertionError on any broken invariant (see integrity.py). O(pool size)."""
        check_pool(self.blocks, self.managers, [r.states for r in self._reqs.values()], self._pins.values())
