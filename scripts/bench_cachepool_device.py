"""The hybrid cache pool's operations at GPU pool sizes with its blocks on a device: host bookkeeping
(`HybridCachePool`) plus the device work each operation brings (`BlockStorage` on `--devices`).

Pool: 64-token blocks, a full-attention group of 4 layers (2 KV heads x 128 dims, bf16: 4 KiB per token)
and a linear-attention group of 12 layers (64 KiB of state per layer, checkpoint every 4096 tokens), at
`--kv-tokens` slots of KV (one shared block pool: states take blocks from the same budget). Filled with
distinct 8K-token requests to ~95 % of the blocks (cached and idle), then per operation, median µs of
`--calls` calls (one seeded sequence of requests, the same on every device):
  admit      a 36K-token request whose first 32K tokens are a cached request's: match + lock + allocate
  table      its block table as the device page table (`build_paged_batch(..., device)`): one H2D copy
  restore    the hit checkpoint copied into the request's working state (device block copy)
  checkpoint the working state copied into the checkpoint blocks at a chunk end, then commit()
  free       release (the hit's blocks back to the LRU, the rest to the free list)
  evict      one evict_lru() under pressure (bookkeeping only: no device work)
Runs on CPU (host tensors) as well, and the CUDA rows add a ratio to the host rows of the same run.
Run:  python3 scripts/bench_cachepool_device.py --kv-tokens 500000 2000000 --devices cpu cuda --out pool.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from prfaas_sgl.cachepool import HybridCachePool
from prfaas_sgl.cachepool.config import PoolConfig
from prfaas_sgl.cachepool.specs import GroupSpec
from prfaas_sgl.cachepool.storage import BlockStorage
from prfaas_sgl.kernels.paged_attention import build_paged_batch

BS, FULL_LAYERS, KV_PER_TOKEN = 64, 4, 2 * 2 * 128 * 2
LINEAR_LAYERS, STATE, INTERVAL = 12, 64 << 10, 4096
FILL, PREFIX, NEW = 8192, 32768, 4096


def make(kv_tokens: int, device: str) -> tuple[HybridCachePool, BlockStorage]:
    cfg = PoolConfig(kv_tokens // BS, BS, (
        GroupSpec("full", "full", FULL_LAYERS, kv_bytes_per_token=KV_PER_TOKEN),
        GroupSpec("linear", "linear", LINEAR_LAYERS, state_bytes=STATE, checkpoint_interval=INTERVAL)))
    return HybridCachePool(cfg), BlockStorage(cfg, device=device)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 150000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fill(pool: HybridCachePool, storage: BlockStorage, state: torch.Tensor) -> list[list[int]]:
    """Distinct FILL-token requests, computed and released, until ~95 % of the blocks are cached."""
    prompts, i = [], 0
    while pool.usage().free > 0.05 * pool.cfg.num_blocks + 4 * (FILL // BS):
        ids = tokens(1000 + i, FILL)
        alloc = pool.admit(f"fill{i}", ids)
        _checkpoints(storage, alloc, state)
        pool.commit(f"fill{i}", FILL)
        pool.free(f"fill{i}")
        prompts.append(ids)
        i += 1
    return prompts


def _checkpoints(storage: BlockStorage, alloc, state: torch.Tensor) -> None:
    for _, blocks in alloc.group("linear").checkpoint_writes:
        storage.write_state("linear", blocks, state)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(kv_tokens: int, device: str, calls: int) -> dict:
    pool, storage = make(kv_tokens, device)
    state = torch.randint(0, 256, (LINEAR_LAYERS * STATE,), dtype=torch.uint8, device=device)
    t0 = time.perf_counter()
    fill(pool, storage, state)
    sync(device)
    out: dict = {"kv_tokens": kv_tokens, "device": device, "fill_s": round(time.perf_counter() - t0, 2),
                 "blocks": pool.cfg.num_blocks, "storage_gib": round(storage.buffer.numel() / 2**30, 2)}
    times: dict[str, list[float]] = {k: [] for k in ("admit", "table", "restore", "checkpoint", "free", "evict")}
    base = tokens(7, PREFIX)
    warm = pool.admit("base", base)
    _checkpoints(storage, warm, state)
    pool.commit("base", PREFIX)
    pool.free("base")
    for c in range(calls + 3):
        ids = base + tokens(50_000 + c, NEW)
        t = time.perf_counter()
        alloc = pool.admit(f"r{c}", ids)
        t1 = time.perf_counter()
        table = alloc.group("full").block_table
        build_paged_batch([table], [len(ids)], [NEW], BS, device=device)
        sync(device)
        t2 = time.perf_counter()
        storage.restore(alloc.group("linear"))
        sync(device)
        t3 = time.perf_counter()
        _checkpoints(storage, alloc, state)
        pool.commit(f"r{c}", len(ids))
        sync(device)
        t4 = time.perf_counter()
        pool.free(f"r{c}")
        t5 = time.perf_counter()
        pool.evict_lru()
        t6 = time.perf_counter()
        if c >= 3:  # warm-ups
            for k, a, b in (("admit", t, t1), ("table", t1, t2), ("restore", t2, t3), ("checkpoint", t3, t4),
                            ("free", t4, t5), ("evict", t5, t6)):
                times[k].append((b - a) * 1e6)
        assert alloc.num_cached_tokens == PREFIX, (alloc.num_cached_tokens, PREFIX)
    out["us"] = {k: round(statistics.median(v), 1) for k, v in times.items()}
    out["us_max"] = {k: round(max(v), 1) for k, v in times.items()}
    pool.check_integrity()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-tokens", type=int, nargs="+", default=[500_000, 2_000_000])
    ap.add_argument("--devices", nargs="+", default=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for kv in args.kv_tokens:
        for dev in args.devices:
            rows.append(measure(kv, dev, args.calls))
            host = next((r for r in rows if r["kv_tokens"] == kv and r["device"] == "cpu"), None)
            if host is not None and dev != "cpu":
                rows[-1]["ratio_to_cpu"] = {k: round(v / max(host["us"][k], 1e-9), 2) for k, v in rows[-1]["us"].items()}
            print(json.dumps(rows[-1]), flush=True)
            if dev.startswith("cuda"):
                torch.cuda.empty_cache()
    result = {"device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu only",
              "torch": torch.__version__, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
