"""Match + allocate + free throughput of the hybrid cache pool vs SGLang 0.5.23's radix trees.

Both replay the same seeded trace (shared system prompts and documents, multi-turn follow-ups, contexts
up to 128K tokens, 64-token blocks) with a fixed number of requests in flight. Per request:
  match    ours: hash + hybrid prefix lookup inside admit()   SGLang: match_prefix + inc_lock_ref
  allocate ours: the rest of admit() (refs, blocks, eviction)  SGLang: evict + allocator.alloc
  free     ours: commit() + free()                            SGLang: insert + free dups/tail + dec_lock_ref
SGLang's trees: RadixCache and UnifiedRadixCache (FULL) at page 64 against our full-attention-only pool,
and its hybrid tree (UnifiedRadixCache FULL+MAMBA, page 1) against our hybrid pool on the same total
memory (bench_cachepool_sglang_hybrid.py says how the scheduler's calls are replayed).
Run on a quiet machine: SGLang's trees do torch ops per request and slow down far more than ours under load.
Run:  PYTHONPATH=.venv/lib/python3.11/site-packages .venv/bin/python -S scripts/bench_cachepool.py --out r.json
(no SGLang installed -> ours only). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import tracemalloc
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_cachepool():
    """prfaas_sgl.cachepool, also from an environment where the repo is not installed."""
    try:
        import prfaas_sgl.cachepool as cp
        return cp
    except ImportError:
        import importlib.util
        sys.path.insert(0, str(ROOT))
        spec = importlib.util.spec_from_file_location(
            "prfaas_sgl.cachepool", ROOT / "cachepool" / "__init__.py",
            submodule_search_locations=[str(ROOT / "cachepool")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["prfaas_sgl.cachepool"] = mod
        spec.loader.exec_module(mod)
        return mod


@dataclass(frozen=True, slots=True)
class BenchConfig:
    seed: int = 0
    requests: int = 400
    warmup: int = 40
    in_flight: int = 8
    block_size: int = 64
    max_context: int = 131072
    num_blocks: int = 24576  # x 1.5 MiB = 36 GiB of KV + state memory
    checkpoint_interval: int = 8192
    repeats: int = 3  # each side replays the trace this many times; the median run is reported

    def __post_init__(self) -> None:
        if self.warmup >= self.requests:
            raise ValueError(f"warmup={self.warmup} must be < requests={self.requests}")


def make_trace(cfg: BenchConfig) -> list[list[int]]:
    """Seeded prompts: system prompt + (Zipf-popular document) + question; 30% are follow-up turns
    that extend an earlier prompt. Token ids are random in a 150K vocabulary."""
    rng = random.Random(cfg.seed)
    tok = lambda n: [rng.randrange(150_000) for _ in range(n)]  # noqa: E731
    systems = [tok(rng.randint(512, 4096)) for _ in range(4)]
    docs = [tok(rng.randint(4096, 98304)) for _ in range(24)]
    weights = [1 / (i + 1) for i in range(len(docs))]
    prompts: list[list[int]] = []
    for _ in range(cfg.requests):
        if prompts and rng.random() < 0.3:
            p = rng.choice(prompts[-32:]) + tok(int(rng.lognormvariate(6.5, 1.0)))
        else:
            p = rng.choice(systems)[:]
            if rng.random() < 0.7:
                p += rng.choices(docs, weights)[0]
            p += tok(min(16384, int(rng.lognormvariate(6.9, 1.2))) + 1)
        prompts.append(p[:cfg.max_context])
    return prompts


def full_only_layout(cp, cfg: BenchConfig):
    """The same 12 full-attention layers alone: what SGLang's RadixCache models (hit-rate check)."""
    return cp.PoolConfig(cfg.num_blocks, cfg.block_size,
                         (cp.GroupSpec("attn", "full", 12, kv_bytes_per_token=2048),))


def hybrid_layout(cp, cfg: BenchConfig):
    """Qwen3-Next-like 3:1 layout: 36 Gated-DeltaNet layers, 12 full-attention layers.
    KV: 2 KV heads x 256 dim x (K, V) x bf16 = 2 KiB per token per layer -> 1.5 MiB blocks.
    GDN state: 32 heads x 128 x 128 fp32 (2 MiB) + conv 3 x 8192 x bf16 (48 KiB) per layer."""
    return cp.PoolConfig(cfg.num_blocks, cfg.block_size, (
        cp.GroupSpec("attn", "full", 12, kv_bytes_per_token=2048),
        cp.GroupSpec("gdn", "linear", 36, state_bytes=32 * 128 * 128 * 4 + 3 * 8192 * 2,
                     checkpoint_interval=cfg.checkpoint_interval)))


class Timer:
    def __init__(self) -> None:
        self.t = {"match": 0.0, "allocate": 0.0, "free": 0.0}
        self.hit_tokens = 0
        self.tokens = 0


def run_ours(cp, cfg: BenchConfig, trace: list[list[int]], layout=hybrid_layout) -> dict:
    pool = cp.HybridCachePool(layout(cp, cfg))
    timer, live = Timer(), []
    pc = time.perf_counter
    for i, prompt in enumerate(trace):
        timed = i >= cfg.warmup
        if len(live) == cfg.in_flight:
            rid, n = live.pop(0)
            t0 = pc()
            pool.commit(rid, n)
            pool.free(rid)
            timer.t["free"] += (pc() - t0) * timed
        t0 = pc()
        hashes = pool.hashes(prompt)
        hit = pool.match(prompt, hashes)
        t1 = pc()
        pool.admit(str(i), prompt, hashes=hashes)  # re-runs the (cheap) hit fixpoint
        t2 = pc()
        timer.t["match"] += (t1 - t0) * timed
        timer.t["allocate"] += (t2 - t1) * timed
        timer.hit_tokens += hit * timed
        timer.tokens += len(prompt) * timed
        live.append((str(i), len(prompt)))
    pool.check_integrity()
    return summarize(timer, cfg, extra={"usage": asdict(pool.usage())})


def sglang_cache(cfg: BenchConfig, kind: str):
    """(allocator, cache) over host memory, as SGLang's unit tests build them. kind "radix": the
    classic RadixCache; "unified": UnifiedRadixCache with the FULL component, 0.5.23's default tree."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.radix_cache import RadixCache

    ps = cfg.block_size
    alloc = PagedTokenToKVPoolAllocator(cfg.num_blocks * ps, ps, torch.bfloat16, "cpu", None, False)
    if kind == "radix":
        return alloc, RadixCache.create_simulated(mock_allocator=alloc, page_size=ps)
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=ps))
    return alloc, UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=ps,
        tree_components=(ComponentType.FULL,)))


def run_sglang(cfg: BenchConfig, trace: list[list[int]], kind: str) -> dict:
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    ps = cfg.block_size
    alloc, cache = sglang_cache(cfg, kind)
    timer, live = Timer(), []
    pc = time.perf_counter

    def finish(key, node, lock, prefix_len, values):
        aligned = len(key) // ps * ps
        if kind == "unified":  # the unified tree frees [prev_prefix_len, matched) duplicates itself
            cache.insert(InsertParams(key=key[:aligned], value=values[:aligned], prev_prefix_len=prefix_len))
        else:  # RadixCache leaves that to the caller (cache_finished_req does it)
            res = cache.insert(InsertParams(key=key[:aligned], value=values[:aligned]))
            alloc.free(values[prefix_len:res.prefix_len])
        alloc.free(values[aligned:])  # partial last page
        cache.dec_lock_ref(node, lock.to_dec_params())

    for i, prompt in enumerate(trace):
        timed = i >= cfg.warmup
        if len(live) == cfg.in_flight:
            t0 = pc()
            finish(*live.pop(0))
            timer.t["free"] += (pc() - t0) * timed
        t0 = pc()
        key = RadixKey(array("q", prompt))
        m = cache.match_prefix(MatchPrefixParams(key=key))
        prefix_len = min(m.device_prefix_len, (len(prompt) - 1) // ps * ps)
        node = m.last_device_node
        lock = cache.inc_lock_ref(node)
        prefix = cache.path_device_indices(node)[:prefix_len]
        t1 = pc()
        need = -(-(len(prompt) - prefix_len) // ps) * ps
        if alloc.available_size() < need:
            cache.evict(EvictParams(num_tokens=need - alloc.available_size()))
        values = torch.cat([prefix, alloc.alloc(need)])
        t2 = pc()
        timer.t["match"] += (t1 - t0) * timed
        timer.t["allocate"] += (t2 - t1) * timed
        timer.hit_tokens += prefix_len * timed
        timer.tokens += len(prompt) * timed
        live.append((key, node, lock, prefix_len, values))
    for item in live:
        finish(*item)
    # every page is either free or cached once the trace is drained (catches double frees)
    assert alloc.available_size() + cache.evictable_size() == cfg.num_blocks * ps, "page leak/double free"
    return summarize(timer, cfg, extra={"tree": type(cache).__name__ + "/" + type(
        getattr(cache, "tree_core", cache)).__name__})


def run_sglang_hybrid(cp, cfg: BenchConfig, trace: list[list[int]]) -> dict:
    """SGLang's Mamba tree on the same trace and the same total memory as our hybrid pool (see
    bench_cachepool_sglang_hybrid.py for what is replayed and how memory is split)."""
    import bench_cachepool_sglang_hybrid as peer

    layout = hybrid_layout(cp, cfg)
    attn, gdn = layout.groups
    kv_tokens, slots = peer.memory_split(cfg.num_blocks * layout.block_bytes,
                                         attn.num_layers * attn.kv_bytes_per_token,
                                         gdn.num_layers * gdn.state_bytes)
    return peer.run(cfg, trace, Timer, summarize, kv_tokens, slots)


def summarize(timer: Timer, cfg: BenchConfig, extra: dict | None = None) -> dict:
    n = cfg.requests - cfg.warmup
    total = sum(timer.t.values())
    out = {f"{k}_per_s": round(n / v) for k, v in timer.t.items()}
    out.update(requests_per_s=round(n / total, 1), ops_per_s=round(3 * n / total),
               hit_rate=round(timer.hit_tokens / timer.tokens, 4),
               mean_tokens=round(timer.tokens / n), seconds=round(total, 3))
    out.update(extra or {})
    return out


def median_run(cfg: BenchConfig, fn) -> dict:
    """Runs are noisy on a shared machine: replay `repeats` times, keep the median by total time."""
    runs = sorted((fn() for _ in range(max(1, cfg.repeats))), key=lambda r: r["seconds"])
    out = runs[len(runs) // 2]
    out["seconds_all_runs"] = [r["seconds"] for r in runs]
    return out


def memory_per_block(cp, cfg: BenchConfig) -> dict:
    """Python heap bytes per block of our bookkeeping with the pool full of cached blocks."""
    prompt = list(range(cfg.num_blocks * cfg.block_size // 2))
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    pool = cp.HybridCachePool(hybrid_layout(cp, cfg))
    empty = tracemalloc.get_traced_memory()[0] - base
    pool.admit("m", prompt)
    pool.commit("m", len(prompt))
    pool.free("m")
    full = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    cached = pool.usage().cached_idle
    return {"empty_bytes_per_block": round(empty / cfg.num_blocks, 1),
            "cached_bytes_per_block": round((full - empty) / cached + empty / cfg.num_blocks, 1),
            "cached_blocks": cached}


def sglang_memory_per_block(cfg: BenchConfig) -> dict:
    """Same fill for SGLang's RadixCache: Python heap (traced) + index tensors (torch storage, not
    traced, added from nbytes) per cached page."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    ps, n = cfg.block_size, cfg.num_blocks * cfg.block_size // 2
    alloc = PagedTokenToKVPoolAllocator(cfg.num_blocks * ps, ps, torch.bfloat16, "cpu", None, False)
    cache = RadixCache.create_simulated(mock_allocator=alloc, page_size=ps)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    cache.insert(InsertParams(key=RadixKey(array("q", range(n))), value=alloc.alloc(n)))
    heap = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    stack, tensor_bytes = [cache.root_node], 0
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node is not cache.root_node:
            tensor_bytes += node.value.numel() * node.value.element_size()
    return {"cached_bytes_per_block": round((heap + tensor_bytes) / (n // ps), 1),
            "cached_blocks": n // ps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in BenchConfig.__dataclass_fields__.values():
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default)
    ap.add_argument("--out", type=Path)
    args = vars(ap.parse_args())
    out_path = args.pop("out")
    cfg = BenchConfig(**args)
    cp = import_cachepool()
    trace = make_trace(cfg)
    result = {"config": asdict(cfg), "python": sys.version.split()[0],
              "ours_hybrid": median_run(cfg, lambda: run_ours(cp, cfg, trace)),
              "ours_full_only": median_run(cfg, lambda: run_ours(cp, cfg, trace, full_only_layout)),
              "ours_memory": memory_per_block(cp, cfg)}
    try:
        import sglang
        result["sglang_version"] = sglang.__version__
        for kind in ("radix", "unified"):
            result[f"sglang_{kind}"] = median_run(cfg, lambda: run_sglang(cfg, trace, kind))
        result["sglang_hybrid"] = median_run(cfg, lambda: run_sglang_hybrid(cp, cfg, trace))
        result["sglang_memory"] = sglang_memory_per_block(cfg)
    except ImportError as e:
        result["sglang"] = f"not run: {e}"
    text = json.dumps(result, indent=1)
    print(text)
    if out_path:
        out_path.write_text(text)


if __name__ == "__main__":
    main()
