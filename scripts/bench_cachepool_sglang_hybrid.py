"""SGLang 0.5.23's hybrid (Mamba) prefix tree, driven as its scheduler drives it, for bench_cachepool.py.

The tree is `UnifiedRadixCache` with the FULL and MAMBA components over a `HybridReqToTokenPool`, built on
host memory. SGLang requires page size 1 for the Mamba tree without its extra buffer (the default
`no_buffer` strategy), so this peer runs at page 1 while ours runs at 64-token blocks.

What the scheduler does per request, and what is replayed here (tree operations only; no kernels run):
  match    `match_prefix` on prompt[:-1] (the last token is always recomputed), lock the match node,
           copy-on-write the matched state into the request's own Mamba slot;
  allocate KV slots for the uncached tokens and the request's slot, evicting when short;
  free     chunked prefill caches a state at every chunk end (`cache_unfinished_req`, chunk =
           `checkpoint_interval` tokens, counted from the hit, as SGLang chunks), one at the branching
           point the match reported (`mamba_branching_seqlen`: where SGLang splits a chunk to save a
           state for a future fork), and one at the prompt's end (`cache_finished_req`); then unlock.
Memory is split as SGLang does by default (`--mamba-full-memory-ratio 0.9`: state memory = 0.9 x full KV
memory) out of the same total our pool gets. The state tensors are 1-layer stand-ins: the tree never
reads them, a cached state costs one slot either way, and the slot count is what the real size buys.
Imports SGLang at module level: bench_cachepool imports this module only once `import sglang` worked.
"""

from __future__ import annotations

import time
from array import array

import torch
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

MAMBA_FULL_MEMORY_RATIO = 0.9  # SGLang's fallback for --mamba-full-memory-ratio


def memory_split(total_bytes: int, kv_bytes_per_token: int, state_bytes: int) -> tuple[int, int]:
    """(KV tokens, Mamba slots) that SGLang's default ratio carves out of `total_bytes`."""
    kv_bytes = total_bytes / (1 + MAMBA_FULL_MEMORY_RATIO)
    return int(kv_bytes // kv_bytes_per_token), int((total_bytes - kv_bytes) // state_bytes)


def build(kv_tokens: int, mamba_slots: int, max_context: int, in_flight: int):
    """(KV allocator, request pool, tree), as SGLang's scheduler wires them, on the CPU."""
    args = ServerArgs(model_path="dummy", page_size=1)
    args._mamba_cache_chunk_size = 64  # what SGLang's fixtures pre-seed so no HF config is loaded
    set_global_server_args_for_scheduler(args)
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=8, n_groups=1, num_heads=1,
                                    head_dim=8, state_size=4, conv_kernel=4)
    pool = HybridReqToTokenPool(
        size=in_flight + 1, mamba_size=mamba_slots, mamba_spec_state_size=0, max_context_len=max_context + 1,
        device="cpu", enable_memory_saver=False, cache_params=Mamba2CacheParams(shape=shape, layers=[0]),
        mamba_layer_ids=[0], enable_mamba_extra_buffer=False)
    alloc = TokenToKVPoolAllocator(kv_tokens, torch.bfloat16, "cpu", None, False)
    cache = UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=alloc, page_size=1,
        tree_components=(ComponentType.FULL, ComponentType.MAMBA)))
    return alloc, pool, cache


class NoRoom(Exception):
    """The running requests hold so much KV that this one cannot start until one finishes."""


class HybridReplay:
    """One pass of the trace through SGLang's hybrid tree; `timer` is bench_cachepool's Timer."""

    def __init__(self, cfg, timer, kv_tokens: int, mamba_slots: int) -> None:
        self.cfg, self.timer = cfg, timer
        self.kv_tokens, self.mamba_slots = kv_tokens, mamba_slots
        self.alloc, self.pool, self.cache = build(kv_tokens, mamba_slots, cfg.max_context, cfg.in_flight)

    def slot(self):
        """One Mamba slot, evicting a cached state when none is free (as the scheduler does)."""
        s = self.pool.mamba_allocator.alloc(1)
        if s is None:
            self.cache.evict(EvictParams(num_tokens=0, mamba_num=1))
            s = self.pool.mamba_allocator.alloc(1)
        assert s is not None, "no Mamba slot even after eviction"
        return s

    def start(self, prompt: list[int], timed: bool):
        pc, t = time.perf_counter, self.timer
        t0 = pc()
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt[:-1]))))
        node = m.last_device_node
        lock = self.cache.inc_lock_ref(node)
        prefix_len = m.device_prefix_len
        prefix = self.cache.path_device_indices(node)[:prefix_len]
        own = self.slot()  # the request's state: the matched one copied in (COW), or a fresh one
        t1 = pc()
        need = len(prompt) - prefix_len
        if self.alloc.available_size() < need:
            self.cache.evict(EvictParams(num_tokens=need - self.alloc.available_size()))
        fresh = self.alloc.alloc(need)
        if fresh is None:  # running requests pin too much: the scheduler would hold this one back
            self.pool.mamba_allocator.free(own)
            self.cache.dec_lock_ref(node, lock.to_dec_params())
            raise NoRoom
        values = torch.cat([prefix, fresh])
        t2 = pc()
        t.t["match"] += (t1 - t0) * timed
        t.t["allocate"] += (t2 - t1) * timed
        t.hit_tokens += prefix_len * timed
        t.tokens += len(prompt) * timed
        return prompt, node, lock, prefix_len, m.mamba_branching_seqlen, values, own

    def finish(self, prompt, node, lock, prefix_len, branching, values, own) -> int:
        """Cache the states chunked prefill leaves behind; returns how many inserts ran."""
        n, step = len(prompt), self.cfg.checkpoint_interval
        ends = set(range(prefix_len + step, n, step)) | {n}
        if branching is not None and prefix_len < branching < n:
            ends.add(branching)
        prev = prefix_len
        for end in sorted(ends):
            state = own if end == n else self.slot()  # intermediate chunks cache a copy of the state
            r = self.cache.insert(InsertParams(key=RadixKey(array("q", prompt[:end])), value=values[:end],
                                               mamba_value=state, prev_prefix_len=prev))
            if r.mamba_exist:  # the tree already holds a state there: ours goes back
                self.pool.mamba_allocator.free(state)
            prev = end
        self.cache.dec_lock_ref(node, lock.to_dec_params())
        return len(ends)

    def check_drained(self) -> None:
        """Every KV slot and Mamba slot is free or cached exactly once (catches leaks, double frees)."""
        assert self.alloc.available_size() + self.cache.full_evictable_size() == self.kv_tokens, "KV leak"
        mamba = self.pool.mamba_allocator.available_size() + self.cache.mamba_evictable_size()
        assert mamba == self.mamba_slots, f"Mamba slot leak: {mamba} != {self.mamba_slots}"


def run(cfg, trace: list[list[int]], timer_cls, summarize, kv_tokens: int, mamba_slots: int) -> dict:
    timer = timer_cls()
    rep = HybridReplay(cfg, timer, kv_tokens, mamba_slots)
    live, inserts = [], 0

    def finish_oldest(timed: bool) -> None:
        nonlocal inserts
        t0 = time.perf_counter()
        inserts += rep.finish(*live.pop(0))
        timer.t["free"] += (time.perf_counter() - t0) * timed

    for i, prompt in enumerate(trace):
        timed = i >= cfg.warmup
        if len(live) == cfg.in_flight:
            finish_oldest(timed)
        while True:
            try:
                live.append(rep.start(prompt, timed))
                break
            except NoRoom:  # wait for the oldest running request, as the scheduler would
                finish_oldest(timed)
    while live:
        finish_oldest(False)
    rep.check_drained()
    return summarize(timer, cfg, extra={
        "tree": f"{type(rep.cache).__name__}/{type(rep.cache.tree_core).__name__} FULL+MAMBA, page 1",
        "kv_tokens": kv_tokens, "mamba_slots": mamba_slots, "state_inserts": inserts})
