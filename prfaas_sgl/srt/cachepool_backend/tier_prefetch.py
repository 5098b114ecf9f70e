"""Storage-tier prefetch on a server: the SGLang side of cachepool/tiers/prefetch.py.

A prfaas_hybrid cache with a storage tier reads storage only on a worker thread. Two AROUND hooks on
SGLang's Scheduler, the places HiCache's own storage prefetch uses (inert unless `enable` gave the
cache a prefetcher):

    _prefetch_kvcache(req)    a request enters the waiting queue (colocated) or the bootstrap queue (PD
                              prefill): its prefetch starts (HiCache: prefetch_from_storage)
    get_new_batch_prefill()   requests whose prefetch runs sit out the pass, for at most `hold_s` (HiCache:
                              check_prefetch_progress -> `continue`, its "timeout" policy); the pass runs
                              with StagedStack.scheduling set, so a match loads staged entries and the host
                              tier only: the scheduler thread never waits on storage

A PD decode (tier_decode.KvTiers) has neither hook: SGLang 0.5.23 matches a decode request in its prealloc
pass, where it reserves KV for it and the hit becomes decode_prefix_len. Its places:

    DecodePreallocQueue.add(req)           the request arrives: its prefetch starts (KV entries only)
    DecodePreallocQueue.pop_preallocated() requests whose prefetch runs sit out the pass, as above; the
                                           prefill waits for the decode's preallocation before it sends,
                                           so the hold delays the request's transfer, never other streams

The hold is one storage call deadline (TierStack.call_timeout_s, 5 s): a prefetch not done by then is what
a synchronous load past its deadline was, a miss recomputed, and the stated bound for a slow or failed
fetch (recompute + one call deadline) is unchanged; meanwhile the scheduler serves every other request.
Not HiCache's "best_effort": on an idle server a request is matched in the loop pass it arrives in, before
any prefetch could finish, and would lose every storage hit. Not "wait_complete": a store that answers
slowly for each entry would hold a request for entries x deadline.

One scheduler per process here: with TP > 1 each rank would hold its requests on its own clock and the
ranks would form different batches (HiCache all-reduces its progress), so prefetch is off there and loads
stay synchronous.
"""
from __future__ import annotations

import logging
from array import array

log = logging.getLogger(__name__)

ENQUEUE = "sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache"
BATCH = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
DECODE_ENQUEUE = "sglang.srt.disaggregation.decode.DecodePreallocQueue.add"
DECODE_PREALLOC = "sglang.srt.disaggregation.decode.DecodePreallocQueue.pop_preallocated"
# the stage's bound, or --prfaas-tier-host-bytes if larger (the host memory the operator gave the tiers):
# ~7,800 entries of the tiny GDN model's 33 KB. Entries wait there from their fetch to their match only
STAGED_BYTES = 256 << 20
IDLE_WAIT_S = 0.002  # an idle scheduler with held requests sleeps this long per pass instead of spinning


def register(HookRegistry, HookType) -> None:
    HookRegistry.register(ENQUEUE, around_enqueue, HookType.AROUND)
    HookRegistry.register(BATCH, around_batch, HookType.AROUND)
    HookRegistry.register(DECODE_ENQUEUE, around_decode_enqueue, HookType.AROUND)
    HookRegistry.register(DECODE_PREALLOC, around_decode_prealloc, HookType.AROUND)


def enable(tiers, tp_size: int, storage_later: bool = False) -> None:
    """Give `tiers` (tier_cache.Tiers or WindowTiers) a prefetcher if it has a storage tier, now or once
    attached (storage_later): its stack becomes a StagedStack over the prefetcher."""
    from prfaas_sgl.cachepool.tiers import KV, STATE, WINDOW
    from prfaas_sgl.cachepool.tiers.prefetch import Chain, Prefetcher, StagedStack

    stack = tiers.stack
    if (stack.storage is None and not storage_later) or tp_size != 1:
        return
    c, io = tiers.cache, tiers.io
    window = getattr(tiers, "window_blocks", 0)
    step = tiers._step if tiers.loads_states else 0
    chain = Chain(c.bs, c.pool.cfg.hash_seed, {KV: io.kv_bytes, STATE: io.state_bytes, WINDOW: io.window_bytes},
                  step=step, window_blocks=window)

    def on_device(kind: int, h: int) -> bool:
        m = c.mirror  # read each time: a flush replaces it
        return h in (m.kv_of if kind == KV else m.state_of if kind == STATE else m.swa_of)

    staged = max(STAGED_BYTES, stack.host.capacity if stack.host is not None else 0)
    tiers.prefetch = Prefetcher(stack, chain, on_device, hold_s=stack.call_timeout_s, staged_bytes=staged)
    tiers.stack = StagedStack(stack, tiers.prefetch)


def _tiers(scheduler):
    tiers = getattr(scheduler.tree_cache, "tiers", None)
    return tiers if getattr(tiers, "prefetch", None) is not None else None


def around_enqueue(original, scheduler, req, *args, **kwargs):
    out = original(scheduler, req, *args, **kwargs)
    tiers = _tiers(scheduler)
    # namespaced requests are never matched against the index (PrfaasHybridCache.match_prefix)
    if tiers is not None and getattr(req, "extra_key", None) is None and getattr(req, "cache_salt", None) is None:
        ids = array("q", req.origin_input_ids)  # a copy: the worker reads it while the request runs
        ids.extend(req.output_ids)  # a retracted request is matched on its outputs too
        tiers.prefetch.start(req.rid, ids)
    return out


def around_decode_enqueue(original, queue, req, *args, **kwargs):
    out = original(queue, req, *args, **kwargs)
    tiers = _tiers(queue.scheduler)
    if tiers is not None and getattr(req, "extra_key", None) is None and getattr(req, "cache_salt", None) is None:
        tiers.prefetch.start(req.rid, array("q", req.origin_input_ids))  # what _match_prefix_and_lock matches
    return out


def around_decode_prealloc(original, queue, *args, **kwargs):
    tiers = _tiers(queue.scheduler)
    if tiers is None:
        return original(queue, *args, **kwargs)
    pending, pf = queue.queue, tiers.prefetch
    held = {id(d) for d in pending if pf.holding(d.req.rid)}
    if held:
        queue.queue = [d for d in pending if id(d) not in held]
    tiers.stack.scheduling = True
    try:
        return original(queue, *args, **kwargs)
    finally:
        tiers.stack.scheduling = False
        if held:
            queue.queue = _with_held(pending, held, queue.queue)


def around_batch(original, scheduler, *args, **kwargs):
    tiers = _tiers(scheduler)
    if tiers is None:
        return original(scheduler, *args, **kwargs)
    queue, pf = scheduler.waiting_queue, tiers.prefetch
    held = {id(r) for r in queue if pf.holding(r.rid)}
    if held:
        scheduler.waiting_queue = [r for r in queue if id(r) not in held]
    tiers.stack.scheduling = True
    try:
        plan = original(scheduler, *args, **kwargs)
    finally:
        tiers.stack.scheduling = False
        if held:
            scheduler.waiting_queue = _with_held(queue, held, scheduler.waiting_queue)
    if held and plan.batch_to_run is None and plan.running_batch.is_empty():
        pf.wait(IDLE_WAIT_S)  # lets the worker run (the GIL) instead of a scheduler loop that spins
    return plan


def _with_held(before: list, held: set[int], after: list) -> list:
    """The waiting queue after a pass: the held requests back where they were, the pass's removals kept,
    anything it added at the end."""
    left, seen = {id(r) for r in after}, {id(r) for r in before}
    return [r for r in before if id(r) in held or id(r) in left] + [r for r in after if id(r) not in seen]
