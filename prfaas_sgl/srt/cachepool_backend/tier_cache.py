"""Host and storage tiers under a prfaas_hybrid cache (`--prfaas-tier-*`): what the device pool evicts is
demoted, and a match that misses the device pool is extended from the tiers by loading the bytes back.

    evict:  pool BlockRemoved(full h)  -> KV bytes of kv_table[kv_of[h]]   -> TierStack.put(KV, h)
            pool BlockRemoved(linear h)-> state bytes of state_of[h]        -> TierStack.put(STATE, h)
            pool BlockRemoved(swa h), or (full h) with h in swa_of
                                       -> SWA-layer KV at the peers of kv_of[h] -> TierStack.put(WINDOW, h)
            (read before the mirror gives the slots back: Tiers.demote runs on the drained events)
    match:  device hit k0 -> plan.extension: k (KV for [k0, k), a state at every grid boundary of (k0, k])
            -> allocate KV slots / state slots (evicting LRU entries; the device hit is held by a pool
            request) -> TierStack.get each missing entry -> write it into its slots -> index it through
            that pool request one checkpoint at a time, as a request's own checkpoints would -> free it.
            (a sliding-window model: tier_window.WindowTiers plans and loads KV plus window pages)

    publish (--prfaas-tier-publish): pool BlockStored(h), once the mirror bound it -> bytes copied out
            -> TierStack.publish (encoded, signed and put by the publisher's worker thread)

Colocated and PD prefill servers: on a prefill the loaded prefix is part of the request's row like any
device hit, and prfaas_zmq sends the row's KV and the request's state after the forward. PD decode
servers (tier_decode.KvTiers): KV only; a longer decode hit makes the prefill send less.

The load is synchronous on the scheduler thread (a device<-host copy per entry before the forward); a
load overlapped with the forward layer by layer (HiCache's LayerDoneCounter) is later work. A tier
fault (missing, corrupt, storage down) ends the extension at the last boundary loaded in full: the rest
is recomputed.
"""
from __future__ import annotations

import functools
import itertools
import logging
from array import array
from typing import Callable, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from prfaas_sgl.cachepool import BlockRemoved, BlockStored
from prfaas_sgl.cachepool.tiers import KV, STATE, WINDOW, Fingerprint, HostTier, StorageBackend, TierStack
from prfaas_sgl.cachepool.tiers.attach import StorageAttacher
from prfaas_sgl.cachepool.tiers.auth import load_key, shared_without_key
from prfaas_sgl.cachepool.tiers.plan import extension

from .mirror import FULL, LINEAR, Insert
from .swa import SWA
from .tier_io import PoolBytes
from .tier_metrics import TierMetrics, exported
from .tier_storage import build_storage

log = logging.getLogger(__name__)
_ONE_TOKEN = array("q", [0])
# --prfaas-tier-publish: payload bytes waiting for the store at most (~2,000 entries of the tiny GDN
# model's 33 KB); past it new entries are dropped and counted rather than held without bound
PUBLISH_QUEUE_BYTES = 64 << 20
# a Mooncake master down at start is tried again this often (one TCP connect each while it is down)
STORAGE_RETRY_S = 10.0


def attach(cache, ctx, mode: str):
    """Give `cache` its tiers if the server's flags ask for them; refuses what they cannot serve yet."""
    from prfaas_sgl.srt import flags

    cfg = flags.get_config(ctx.server_args)
    if cfg.tier_host_bytes == 0 and cfg.tier_storage == "none":
        return cache
    from .tier_prefetch import enable as enable_prefetch

    kind = _tiers_kind(cache, mode)
    io = _pool_bytes(cache, kind)
    fp = Fingerprint(f"{ctx.server_args.model_path}|tp{ctx.tp_rank}/{ctx.tp_size}|{io.layout()}"
                     f"|seed={cache.pool.cfg.hash_seed}")
    host = HostTier(cfg.tier_host_bytes) if cfg.tier_host_bytes else None
    key = load_key(cfg.tier_key) if cfg.tier_key else None  # checked at flag parsing: a failure here is a race
    storage, pending = _storage(cfg, ctx, key)
    if host is None and storage is None and pending is None:
        return cache
    publish = PUBLISH_QUEUE_BYTES if cfg.tier_publish and (storage is not None or pending is not None) else 0
    stack = TierStack(fp, host, storage, key=key, publish_queue_bytes=publish, storage_pending=pending is not None)
    cache.tiers = kind(cache, stack, io)
    if pending is not None:  # a Mooncake master down at start: serve without it, attach it once it answers
        cache.tiers.attacher = StorageAttacher(stack, pending, f"mooncake ({cfg.tier_mooncake_master})",
                                               STORAGE_RETRY_S)
        cache.tiers.attacher.first_try()
    # storage is read on a worker while the request waits (tier_prefetch)
    enable_prefetch(cache.tiers, ctx.tp_size, storage_later=pending is not None)
    if exported():
        cache.tiers.metrics = TierMetrics(cache.tiers.stack.counters, {"tp_rank": str(ctx.tp_rank)}).start()
    log.info("prfaas_hybrid tiers: host %d bytes, storage %s%s, entries %s; entries: KV %d bytes, state %d bytes, "
             "window %d bytes", cfg.tier_host_bytes, _storage_state(cfg, stack, pending),
             " (write-through)" if publish else "", "signed (HMAC-SHA256)" if key else "unsigned",
             io.kv_bytes, io.state_bytes, io.window_bytes)
    return cache


def _tiers_kind(cache, mode: str) -> type:
    """The Tiers class for a cache kind and server role; refuses what the tiers do not serve.

    A PD prefill loads a hit into slots its request then owns: prfaas_zmq sends the KV of the request's
    slots (and its state, or the window pages of its row) after the forward, whether the prefix came from
    the device or a tier. A PD decode's hit is decode_prefix_len: KV only (tier_decode.py)."""
    from .decode_kv import DecodeKvCache, DecodeWindowKvCache
    from .linear import LinearStateCache
    from .sliding import SlidingWindowCache
    from .tier_decode import KvTiers, WindowKvTiers
    from .tier_window import WindowTiers

    if isinstance(cache, DecodeWindowKvCache) and mode == "decode":
        return WindowKvTiers  # before SlidingWindowCache: it is one
    if isinstance(cache, DecodeKvCache) and mode == "decode":
        return KvTiers
    if isinstance(cache, (LinearStateCache, SlidingWindowCache)) and mode in ("null", "prefill"):
        return WindowTiers if isinstance(cache, SlidingWindowCache) else Tiers
    raise ValueError("--prfaas-tier-*: the host and storage tiers serve colocated, PD prefill and PD decode servers "
                     f"of hybrid models only (this server: {type(cache).__name__}, mode {mode})")


def _pool_bytes(cache, kind: type) -> PoolBytes:
    """What the tiers read and write of SGLang's pools: KV and states (linear), KV and windows (sliding
    window, colocated or prefill), KV only (a decode)."""
    from .tier_decode import WindowKvTiers
    from .tier_window import WindowTiers, window_bytes

    kvcache = cache.token_to_kv_pool_allocator.get_kvcache()
    if kind is WindowTiers:
        return window_bytes(cache)
    if kind is WindowKvTiers:
        return PoolBytes(kvcache, None, cache.bs)
    return PoolBytes(kvcache, cache.req_to_token_pool.mamba_pool, cache.bs)


def _storage_state(cfg, stack: TierStack, pending) -> str:
    if stack.storage is not None:
        return cfg.tier_storage
    return "none" if pending is None else f"{cfg.tier_storage} (down at start, retried every {STORAGE_RETRY_S:.0f} s)"


def _storage(cfg, ctx, key: Optional[bytes]) -> tuple[Optional[StorageBackend], Optional[Callable[[], StorageBackend]]]:
    """(the storage tier the flags name, None) or (None, None): a store others can write and no key to
    tell our entries from injected ones, or a file tier that cannot start (a fault like any other: serve,
    recompute what it would hold). A Mooncake tier is (None, its builder): the attacher tries it at once
    and again until its master answers (a master is started apart from the servers, in any order)."""
    if cfg.tier_storage == "none":
        return None, None
    shared = None if key else shared_without_key(cfg.tier_storage, cfg.tier_storage_path,
                                                 cfg.tier_mooncake_master, cfg.tier_mooncake_metadata)
    if shared:
        log.error("prfaas_hybrid tiers: storage tier %r left out: %s, and no --prfaas-tier-key is given, so anyone "
                  "who can write to it could inject KV this server would load. Create a key with `prfaas keys DIR` "
                  "and pass --prfaas-tier-key DIR/tier.secret on every server sharing the store; serving without it",
                  cfg.tier_storage, shared)
        return None, None
    build = functools.partial(build_storage, cfg.tier_storage, cfg.tier_storage_path, cfg.tier_storage_bytes,
                              cfg.tier_mooncake_master, cfg.tier_mooncake_metadata, ctx.tp_rank, ctx.tp_size)
    if cfg.tier_storage == "mooncake":
        return None, build
    try:
        return build(), None
    except OSError as e:
        log.warning("prfaas_hybrid tiers: storage tier %r unavailable at start (%s); serving without it",
                    cfg.tier_storage, e)
        return None, None


class Tiers:
    loads_states = True  # a linear-attention hit needs a state at each grid boundary (prefetch fetches them)

    def __init__(self, cache, stack: TierStack, io: PoolBytes) -> None:
        self.cache, self.stack, self.io = cache, stack, io
        self._ids = itertools.count()
        self.loaded_blocks = self.loaded_states = 0
        self._stored: list[tuple[int, int]] = []  # (group, hash) indexed since the last publish_stored()
        self._loading = False  # what a load indexes came from the tiers: not published again
        self.metrics = None  # TierMetrics when the server exports /metrics
        self.attacher = None  # StorageAttacher while a storage tier down at start is retried

    # -- demotion and write-through ------------------------------------------------------------
    def demote(self, events: list) -> None:
        """Copy out what the pool just evicted, before the mirror frees its memory; note what it
        just stored, for publish_stored() once the mirror has bound it."""
        mirror, windows = self.cache.mirror, set()  # a full entry takes its window along: one put per window
        for ev in events:
            if isinstance(ev, BlockStored) and self.stack.publisher is not None and not self._loading:
                self._stored.extend((ev.group, h) for h in ev.block_hashes if ev.group in (FULL, LINEAR, SWA))
            if not isinstance(ev, BlockRemoved):
                continue
            for h in ev.block_hashes:
                if ev.group in (FULL, SWA) and h in mirror.swa_of and h not in windows:
                    windows.add(h)
                    self.stack.put(WINDOW, h, self.io.read_window(mirror.kv_slots([h])))
                if ev.group == FULL and h in mirror.kv_of:
                    self.stack.put(KV, h, self.io.read_kv(mirror.kv_slots([h])))
                elif ev.group == LINEAR and h in mirror.state_of:
                    self.stack.put(STATE, h, self.io.read_state(self._physical(mirror.state_of[h])))

    def publish_stored(self) -> None:
        """Write what the pool indexed since the last call through to the storage tier (the bytes are
        copied out here, on the scheduler thread; the store is written by the publisher's worker)."""
        if not self._stored:
            return
        mirror, stored, self._stored = self.cache.mirror, self._stored, []
        for group, h in stored:
            if group == FULL and h in mirror.kv_of:
                self.stack.publish(KV, h, self.io.read_kv(mirror.kv_slots([h])))
            elif group == LINEAR and h in mirror.state_of:
                self.stack.publish(STATE, h, self.io.read_state(self._physical(mirror.state_of[h])))
            elif group == SWA and h in mirror.swa_of:
                self.stack.publish(WINDOW, h, self.io.read_window(mirror.kv_slots([h])))

    def clear_host(self) -> None:
        self.stack.clear_host()

    # -- extension ----------------------------------------------------------------------------
    def extend(self, params, node, ids) -> tuple:
        """The node for the longest hit the device pool plus the tiers give (`node` if none): the
        tiers' part is in the device pool afterwards, indexed and idle (LRU-recent)."""
        c = self.cache
        if not self._loads_for(params):
            return node
        k0, limit = len(node.hashes), max(0, len(ids) - 1) // c.bs
        if k0 >= limit:
            return node
        # every block up to limit is hashed (not only up to the first miss): the plan asks the tiers about
        # all of them in one round trip; the request's own checkpoints reuse these hashes from the memo
        seen = c.memo.get(getattr(params.req, "rid", None), ids, blocks=limit)
        limit = min(limit, len(seen.hashes))
        k = self._plan(seen.hashes, k0, limit, self.stack.present(self._wanted(seen.hashes, k0, limit)))
        if k == k0:
            return node
        k = self._load(seen, k0, k)
        if k == k0:
            return node
        log.info("prfaas_hybrid tiers: hit extended from %d to %d tokens (%s)", k0 * c.bs, k * c.bs,
                 " ".join(f"{n}={v}" for n, v in self.stack.stats.as_dict().items() if v))
        return type(node)(seen.tokens[:k * c.bs], tuple(seen.hashes[:k]))

    def _loads_for(self, params) -> bool:
        """A request's own match (the scheduler's, which then copies the state the hit ends at)."""
        return bool(params.cow_mamba and params.req is not None)

    def _wanted(self, hashes: list[int], k0: int, limit: int) -> list[tuple[int, int]]:
        """The tier entries a plan over [k0, limit) may read: KV and grid states the device lacks."""
        m, step = self.cache.mirror, self._step
        kv = [(KV, h) for h in hashes[k0:limit] if h not in m.kv_of]
        return kv + [(STATE, hashes[j]) for j in range(k0, limit) if (j + 1) % step == 0
                     and hashes[j] not in m.state_of]

    def _plan(self, hashes: list[int], k0: int, limit: int, present: set[tuple[int, int]]) -> int:
        m = self.cache.mirror
        return extension(hashes, k0, limit, self._step, lambda h: h in m.kv_of or (KV, h) in present,
                         lambda h: h in m.state_of or (STATE, h) in present)

    @property
    def _step(self) -> int:
        return self.cache.cfg.checkpoint_interval // self.cache.bs

    def _load(self, seen, k0: int, k: int) -> int:
        """Load blocks [k0, k) into the device pool; returns the hit reached (a grid boundary)."""
        c, bs, step = self.cache, self.cache.bs, self._step
        load_id = f"tierload:{next(self._ids)}"
        hashes = seen.hashes[:k]
        start = c.pool.admit(load_id, seen.tokens[:k * bs] + _ONE_TOKEN, num_tokens=k0 * bs,
                             hashes=hashes).num_cached_tokens // bs  # holds the device hit [0, k0)
        c._drain()
        self._loading = True
        try:
            if start != k0:
                return k0
            return self._fill(load_id, hashes, k0, k)
        finally:
            self._loading = False
            c.pool.free(load_id)
            c._drain()

    def _fill(self, load_id: str, hashes: list[int], k0: int, k: int) -> int:
        """Allocate, fetch, write and index what [k0, k) misses, under the pool request `load_id`."""
        kv_slots, states = self._allocate(hashes, k0, k, self._step)
        return self._fill_and_index(load_id, hashes, k0, k, self._step, kv_slots, states)

    def _missing(self, hashes: list[int], k0: int, k: int, step: int) -> tuple[list[int], list[int]]:
        """Blocks of [k0, k) whose KV, and grid boundaries of (k0, k] whose state, the device lacks."""
        m = self.cache.mirror
        kv = [j for j in range(k0, k) if hashes[j] not in m.kv_of]
        st = [b for b in range(k0 + step, k + 1, step) if hashes[b - 1] not in m.state_of]
        return kv, st

    def _allocate(self, hashes, k0, k, step) -> tuple[list[torch.Tensor], list]:
        """Slots for what is missing (evicting LRU entries, which may demote more): KV slot blocks of bs,
        state slots; fewer if the device cannot free enough."""
        c, bs = self.cache, self.cache.bs
        kv_need, st_need = self._missing(hashes, k0, k, step)
        alloc = c.token_to_kv_pool_allocator
        slots = alloc.alloc(len(kv_need) * bs) if kv_need else torch.empty(0, dtype=torch.int64)
        if slots is None:
            c.evict(EvictParams(num_tokens=len(kv_need) * bs))
            slots = alloc.alloc(len(kv_need) * bs)
        kv_slots = [] if slots is None else list(slots.view(-1, bs)) if kv_need else []
        states = []
        for _ in st_need:
            s = c._alloc_state()
            if s is None:
                break
            states.append(s)
        return kv_slots, states

    def _fill_and_index(self, load_id, hashes, k0, k, step, kv_slots, states) -> int:
        """Fetch and write each missing entry, indexing one checkpoint interval at a time; stops at the
        first interval it cannot complete. Unused slots go back."""
        c, bs = self.cache, self.cache.bs
        row = torch.zeros(k * bs, dtype=torch.int64, device=c.device)
        reached = k0
        try:
            for b in range(k0 + step, k + 1, step):
                insert = self._fill_interval(hashes, b, step, row, kv_slots, states)
                if insert is None:
                    break
                c.pool.grow(load_id, b * bs, state_at_end=True)  # the pool has no grid: mark the state
                c._drain()
                c.pool.commit(load_id, b * bs)
                c._drain(insert)
                assert insert.state is None and len(insert.stored_blocks) == len(insert.pos_of), \
                    "a loaded entry was not indexed"
                reached = b
        finally:
            if kv_slots:
                c.token_to_kv_pool_allocator.free(torch.cat(kv_slots))
            for s in states:
                c._free_state(s)
        self.loaded_blocks += reached - k0
        return reached

    def _fill_interval(self, hashes, b, step, row, kv_slots, states) -> Optional[Insert]:
        """Write the missing KV of blocks [b - step, b) and the missing state at b into fresh slots
        (taken from the lists); None if an entry is unavailable or slots ran out."""
        m, bs, io = self.cache.mirror, self.cache.bs, self.io
        pos_of, taken = {}, 0
        for j in range(b - step, b):
            h = hashes[j]
            if h in m.kv_of:
                continue
            payload = self.stack.get(KV, h, io.kv_bytes) if taken < len(kv_slots) else None
            if payload is None:
                return None
            io.write_kv(kv_slots[taken], payload)
            row[j * bs:(j + 1) * bs] = kv_slots[taken]
            pos_of[h], taken = j, taken + 1
        h = hashes[b - 1]
        state = None
        if h not in m.state_of:
            payload = self.stack.get(STATE, h, io.state_bytes) if states else None
            if payload is None:
                return None  # the KV slots written above stay in kv_slots: freed with the rest
            state = states.pop(0)
            io.write_state(self._physical(state), payload)
            self.loaded_states += 1
        del kv_slots[:taken]  # the tree owns them once the interval is indexed
        return Insert(row, pos_of, h if state is not None else None, state)

    def _physical(self, slot):
        return self.cache.req_to_token_pool.translate_mamba_indices(slot)
