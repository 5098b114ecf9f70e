"""prfaas_hybrid at GPU pool sizes, before and after its GPU-size rework, next to SGLang 0.5.23's own tree.

Each tree runs on SGLang's real CPU allocators (`TokenToKVPoolAllocator`, page 1; `HybridReqToTokenPool`
with its Mamba slot allocator) at `--kv-tokens` slots, driven as the scheduler drives it: match on
prompt[:-1], lock, allocate the rest, a checkpoint at every chunk end counted from the hit (ours also
at the match's branch point), then release (checkpoint at the end, free the row, unlock, on_release).
The cache is filled with distinct `--fill-prompt`-token requests to ~95 % of the slots, then measured:

  sizes       each size query SGLang reads per scheduler step, µs per call (median of --calls)
  evict       evict(num_tokens=--evict-tokens) three times: ms per call, allocator free() calls per call
  long        one --long-prompt-token request with --chunk chunks: ms per checkpoint (median, max), the
              release, its first match (cold) and a repeat match (warm hit), ms
  hashing     block hashes of --hash-lengths tokens from scratch (array("q") ids, as SGLang passes them),
              and the sum over a request's checkpoints when each hashes its prefix from scratch (before)
  mix         --mix-requests seeded requests served one after another on the filled cache (scripts/
              _cachepool_mix.py): short questions after shared system prompts, long documents, multi-turn
              conversations; the scheduler-thread time of each request's cache calls (match, lock,
              allocate/evict, row write, every checkpoint, release), ms mean / p50 / p99 per kind, hit tokens

Times are the scheduler thread's CPU time (`--clock cpu`, time.thread_time) with torch on one intra-op
thread (`--threads 1`): wall time on a shared machine also counts waits for a core, and a parallel torch
region waits for a second core held by another process (16 ms stalls measured on 8K-element gathers at
load 2 on 2 cores); `--clock wall --threads 0` measures that. Matches: median of --match-calls calls.

"before": our code at --base-rev (`git archive`, imported in a worker in its place), "after" the working
tree, "sglang" `UnifiedRadixCache` FULL+MAMBA (0.5.23's build for hybrid GDN; page 1, as no_buffer needs)
driven through the calls SGLang's scheduler makes on it per request (scripts/_cachepool_sglang_side.py:
its checkpoint_into_tree at each chunk end and at release, free_kv_row, unlock, on_release); both trees
write the KV row (alloc_for_extend does for any tree). Seeded; one worker at a time.

Run:  .venv/bin/python scripts/bench_cachepool_gpu_sizes.py --kv-tokens 500000 2000000 --out out/bench_cachepool_gpu_sizes.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

from _cachepool_sglang_side import Sglang, key

ROOT = Path(__file__).resolve().parents[1]
BASE_REV = "b7bbc14"  # last change to cachepool/ and the backend before the GPU-size rework
QUERIES = ("evictable_size", "protected_size", "full_evictable_size", "full_protected_size",
           "mamba_evictable_size", "mamba_protected_size")


def use_code(root: str) -> None:
    """Import prfaas_sgl.cachepool and prfaas_sgl.srt.cachepool_backend from an extracted tree `root`."""
    # revisions before the SGLang boundary moved to prfaas_sgl/srt/ keep the backend at prfaas_sgl/cachepool_backend
    backend = next(p for p in ("prfaas_sgl/srt/cachepool_backend", "prfaas_sgl/cachepool_backend")
                   if Path(root, p).is_dir())
    for name, sub in (("prfaas_sgl.cachepool", "cachepool"), ("prfaas_sgl.srt.cachepool_backend", backend)):
        path = Path(root, sub)
        spec = importlib.util.spec_from_file_location(name, path / "__init__.py",
                                                      submodule_search_locations=[str(path)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)


NOW = time.thread_time  # see the module doc: --clock


def ms(t0: float) -> float:
    return (NOW() - t0) * 1e3


def prompt(i: int, n: int) -> array:
    """Request i's tokens: distinct across requests for n <= 200,000 (no shared blocks)."""
    return array("q", range((i + 1) * 200_000, (i + 1) * 200_000 + n))


class Counted:
    """Wraps an allocator's free() to count calls (installed before a tree binds it)."""

    def __init__(self, alloc) -> None:
        self.calls, self._free = 0, alloc.free
        alloc.free = self

    def __call__(self, idx) -> None:
        self.calls += 1
        self._free(idx)


class FakeKv:
    """The parts of SGLang's per-request KV record the backend and free_kv_row read."""

    def __init__(self) -> None:
        self.req_pool_idx, self.mamba_pool_idx, self.mamba_cow_src_index = 0, None, None
        self.mamba_needs_clear, self.cache_protected_len = False, 0

    @property
    def holds_mamba(self) -> bool:
        return self.mamba_pool_idx is not None

    def get_evicted_seqlen(self, component) -> int:
        return 0

    def swa_dead_lo(self, page_size: int) -> int:
        return 0


class Ours:
    def __init__(self, alloc, pool, chunk: int, block: int = 0) -> None:
        """block: index block tokens (0: what a server without --prfaas-unified-pool picks)."""
        from types import SimpleNamespace as NS

        from prfaas_sgl.srt.cachepool_backend import cache as backend
        params = NS(page_size=1, token_to_kv_pool_allocator=alloc, req_to_token_pool=pool)
        ctx = NS(params=params, server_args=NS(chunked_prefill_size=chunk, disaggregation_mode="null"),
                 is_hybrid_ssm=True, is_hybrid_swa=False, enable_hierarchical_cache=False, disable_radix_cache=False)
        cache = backend.build(ctx)
        if block:
            from prfaas_sgl.srt.cachepool_backend import config
            cache = type(cache)(params, config.from_server(chunk, alloc.size, pool.mamba_pool.size, block_size=block))
        self.cache, self.alloc, self.pool, self.chunk, self.block = cache, alloc, pool, chunk, block

    def match(self, ids: array, rid: str, req=None):
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        return self.cache.match_prefix(MatchPrefixParams(key=key(ids), req=req, cow_mamba=req is not None))

    def serve(self, ids: array, rid: str, times: dict | None = None) -> int:
        """One request, as the scheduler runs it; returns the tokens its match hit."""
        from types import SimpleNamespace as NS

        from sglang.srt.mem_cache.base_prefix_cache import EvictParams
        c, kv = self.cache, FakeKv()
        req = NS(rid=rid, extra_key=None, cache_salt=None, full_untruncated_fill_ids=ids, kv=kv)
        m = self.match(ids, rid, req)
        node = m.last_device_node
        lock = c.inc_lock_ref(node)
        prefix = c.path_device_indices(node)
        if not kv.holds_mamba:
            kv.mamba_pool_idx = c._alloc_state()[0]
        need = len(ids) - len(prefix)
        if self.alloc.available_size() < need:
            c.evict(EvictParams(num_tokens=need - self.alloc.available_size()))
        self.pool.req_to_token[0, :len(ids)] = __import__("torch").cat([prefix, self.alloc.alloc(need)])
        kv.cache_protected_len = p = len(prefix)
        # the first chunk ends at the match's branch point only on --prfaas-unified-pool (slab_admission.py,
        # --ours-block set); a server without it chunks on the grid, as SGLang's no-buffer scheduler does
        branch = getattr(m, "mamba_branching_seqlen", None) if self.block else None
        first = [branch] if branch is not None and p < branch < len(ids) else []
        for up_to in first + list(range((first or [p])[0] + self.chunk, len(ids), self.chunk)):
            t0 = NOW()
            c.checkpoint(req, up_to=up_to)
            if times is not None:
                times["checkpoint"].append(ms(t0))
        t0 = NOW()
        c.checkpoint(req, up_to=len(ids))  # release_kv_cache, as SGLang runs it
        c.free_kv_row(kv, [(p, len(ids))])
        c.dec_lock_ref(node, lock.to_dec_params())
        c.on_release(req, checkpointed=True)
        if times is not None:
            times["release"].append(ms(t0))
        return p

    def evict(self, tokens: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams
        self.cache.evict(EvictParams(num_tokens=tokens))

    def cached_tokens(self) -> int:
        return self.cache.total_size()


def per_call_us(fn, calls: int) -> float:
    fn()
    us = []
    for _ in range(calls):
        t0 = NOW()
        fn()
        us.append((NOW() - t0) * 1e6)
    return round(statistics.median(us), 2)


def median_ms(fn, calls: int) -> float:
    return round(per_call_us(fn, calls) / 1e3, 3)


def worker(a) -> dict:
    global NOW
    if a.code:
        use_code(a.code)
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch

    import _cachepool_mix as mix
    import bench_cachepool_sglang_hybrid as peer
    NOW = time.thread_time if a.clock == "cpu" else time.perf_counter
    if a.threads:
        torch.set_num_threads(a.threads)
    kv_tokens = a.kv_tokens[0]
    mamba_slots = max(64, kv_tokens // 4096)
    alloc, pool, sg_cache = peer.build(kv_tokens, mamba_slots, max(a.long_prompt, a.fill_prompt) + 1, in_flight=1)
    kv_free, state_free = Counted(alloc), Counted(pool.mamba_allocator)
    tree = Sglang(alloc, pool, sg_cache, a.chunk, NOW) if a.worker == "sglang" else Ours(alloc, pool, a.chunk, a.ours_block)
    t0, i = NOW(), 0
    while tree.cached_tokens() < 0.95 * kv_tokens - a.fill_prompt:
        tree.serve(prompt(i, a.fill_prompt), f"fill-{i}")
        i += 1
    out: dict = {"tree": a.worker, "kv_tokens": kv_tokens, "mamba_slots": mamba_slots, "fill_requests": i,
                 "fill_s": round(ms(t0) / 1e3, 1), "cached_tokens": tree.cached_tokens()}
    cache = tree.cache
    out["sizes_us"] = {q: per_call_us(getattr(cache, q), a.calls) for q in QUERIES}
    evict_ms, frees = [], []
    for _ in range(3):
        before, t0 = kv_free.calls, NOW()
        tree.evict(a.evict_tokens)
        evict_ms.append(ms(t0))
        frees.append(kv_free.calls - before)
    out["evict"] = {"tokens": a.evict_tokens, "ms": [round(x, 2) for x in evict_ms], "kv_free_calls": frees}
    times = {"checkpoint": [], "release": []}
    long_ids = prompt(1000, a.long_prompt)
    cold = median_ms(lambda: tree.match(long_ids, None), a.match_calls)
    tree.serve(long_ids, "long", times)
    warm = median_ms(lambda: tree.match(long_ids, None), a.match_calls)
    out["long"] = {"tokens": a.long_prompt, "chunk": a.chunk, "checkpoints": len(times["checkpoint"]),
                   "checkpoint_ms_median": round(statistics.median(times["checkpoint"]), 2),
                   "checkpoint_ms_max": round(max(times["checkpoint"]), 2),
                   "checkpoint_ms_total": round(sum(times["checkpoint"]), 1),
                   "release_ms": round(times["release"][0], 2), "match_cold_ms": cold, "match_warm_ms": warm}
    out["mix"] = mix.run(tree.serve, mix.requests(a.mix_requests, a.seed), NOW)
    out["free_calls_total"] = {"kv": kv_free.calls, "state": state_free.calls}
    if a.worker != "sglang":
        out["hashing_ms"] = hashing(a)
    return out


def hashing(a) -> dict:
    from prfaas_sgl.cachepool.hashing import block_hashes
    res = {}
    for bs in (16, 64):
        for n in a.hash_lengths:
            ids = prompt(7, n)
            t0 = NOW()
            block_hashes(ids, bs)
            scratch = ms(t0)
            t0 = NOW()
            for end in range(a.chunk, n + 1, a.chunk):  # what a checkpoint per chunk did before
                block_hashes(ids[:end], bs)
            res[f"bs{bs}_{n}"] = {"scratch_ms": round(scratch, 2), "per_chunk_from_scratch_ms": round(ms(t0), 1)}
    return res


def _mix_cell(r: dict, kind: str) -> str:
    m = r.get("mix", {}).get(kind)
    return f'{m["ms_mean"]} [{m["ms_p99"]}]' if m else "–"


def table(result: dict) -> str:
    """Markdown: one row per (pool size, metric), columns before / after / sglang."""
    rows = [("evictable_size µs", lambda r: r["sizes_us"]["evictable_size"]),
            ("mamba_evictable_size µs", lambda r: r["sizes_us"]["mamba_evictable_size"]),
            ("protected_size µs", lambda r: r["sizes_us"]["protected_size"]),
            ("evict --evict-tokens, ms (median of 3)", lambda r: round(statistics.median(r["evict"]["ms"]), 2)),
            ("allocator free() calls per evict", lambda r: r["evict"]["kv_free_calls"][0]),
            ("checkpoint ms, median [max]", lambda r: f'{r["long"]["checkpoint_ms_median"]} [{r["long"]["checkpoint_ms_max"]}]'),
            ("all checkpoints of the request ms", lambda r: r["long"]["checkpoint_ms_total"]),
            ("release ms", lambda r: r["long"]["release_ms"]),
            ("match, new request ms", lambda r: r["long"]["match_cold_ms"]),
            ("match, cached prompt ms", lambda r: r["long"]["match_warm_ms"])]
    rows += [(f"mix {k}: ms per request, mean [p99]", lambda r, k=k: _mix_cell(r, k)) for k in ("all", "short", "doc", "turn")]
    rows.append(("mix: hit tokens / tokens", lambda r: f'{r["mix"]["all"]["hit_tokens"] / r["mix"]["all"]["tokens"]:.0%}'
                 if "mix" in r else "–"))
    out = ["| KV slots | metric | before | after | SGLang UnifiedRadixCache |", "|---|---|---|---|---|"]
    for n in result["args"]["kv_tokens"]:
        runs = {r["label"]: r for r in result["runs"] if r["kv_tokens"] == n}
        for name, get in rows:
            cells = [str(get(runs[t])) if t in runs else "–" for t in ("before", "after", "sglang")]
            out.append(f"| {n:,} | {name} | " + " | ".join(cells) + " |")
    out += ["", "| tokens, block | before: from scratch ms | after: from scratch ms | before: every checkpoint "
            "rehashes its prefix, sum ms | after: each block once, ms |", "|---|---|---|---|---|"]
    runs = {r["label"]: r for r in result["runs"] if "hashing_ms" in r}
    for key in runs.get("after", {}).get("hashing_ms", {}):
        b, a = runs.get("before", {}).get("hashing_ms", {}).get(key, {}), runs["after"]["hashing_ms"][key]
        out.append(f"| {key} | {b.get('scratch_ms', '–')} | {a['scratch_ms']} | "
                   f"{b.get('per_chunk_from_scratch_ms', '–')} | {a['scratch_ms']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-tokens", type=int, nargs="+", default=[500_000, 2_000_000])
    ap.add_argument("--fill-prompt", type=int, default=32_768)
    ap.add_argument("--long-prompt", type=int, default=131_072)
    ap.add_argument("--chunk", type=int, default=8192, help="chunked-prefill size = checkpoint interval")
    ap.add_argument("--ours-block", type=int, default=0,
                    help="prfaas_hybrid's index block in tokens (0: the chunk, as a server without the unified pool)")
    ap.add_argument("--evict-tokens", type=int, default=65_536)
    ap.add_argument("--hash-lengths", type=int, nargs="+", default=[32_768, 131_072])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--match-calls", type=int, default=21)
    ap.add_argument("--mix-requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads; 0: torch's default")
    ap.add_argument("--base-rev", default=BASE_REV)
    ap.add_argument("--trees", nargs="+", default=["before", "after", "sglang"])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--code", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a)))
        return
    result = {"args": {k: v for k, v in vars(a).items() if k not in ("worker", "code")},
              "loadavg_start": os.getloadavg(), "runs": []}
    with tempfile.TemporaryDirectory() as base:
        archive = subprocess.run(["git", "archive", a.base_rev, "cachepool", "prfaas_sgl"],
                                 cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", base], input=archive, check=True)
        for n in a.kv_tokens:
            for tree in a.trees:
                cmd = [sys.executable, __file__, "--worker", "sglang" if tree == "sglang" else "ours",
                       "--kv-tokens", str(n), "--fill-prompt", str(a.fill_prompt), "--long-prompt",
                       str(a.long_prompt), "--chunk", str(a.chunk), "--ours-block", str(a.ours_block), "--evict-tokens", str(a.evict_tokens),
                       "--calls", str(a.calls), "--match-calls", str(a.match_calls), "--mix-requests",
                       str(a.mix_requests), "--seed", str(a.seed), "--clock", a.clock, "--threads", str(a.threads),
                       "--hash-lengths", *map(str, a.hash_lengths)]
                if tree == "before":
                    cmd += ["--code", base]
                done = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
                run = dict(json.loads(done.stdout.strip().splitlines()[-1]), label=tree)
                print(json.dumps(run), flush=True)
                result["runs"].append(run)
    result["loadavg_end"] = os.getloadavg()
    print(table(result))
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
