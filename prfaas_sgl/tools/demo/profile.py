"""The demo's profiling step: each emulated kind's prefill curve and decode rate on the tiny model, measured
on one colocated SGLang server whose CPU share is switched between the kinds (hardware.py), then cached.

    prefill: CONCURRENCY requests of L random tokens, 1 output token, at once  ->  s/request = makespan / n
    decode:  DECODE_BATCH requests, DECODE_TOKENS outputs vs 1 output          ->  step = Δmakespan / (tokens-1)

Seconds per request under concurrency, not one request's latency: the planner's Θ = n / T(l) is what an
instance sustains, and SGLang batches concurrent prefills. Every prompt is fresh random ids, so no prefix
cache hit shortens a measurement. The cache key holds what the numbers depend on (model, shares, method).
"""
from __future__ import annotations

import json
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prfaas_sgl.tools.demo import hardware
from prfaas_sgl.tools.launch import SGLangServer, ServerSpec, free_port

PREFILL_LENGTHS = (32, 256, 1024)  # tokens; the scaled paper workload lies in [2, 2048], mean ~420
CONCURRENCY = 4
DECODE_BATCH, DECODE_TOKENS = 8, 17
VERSION = 1  # bump when the method changes: a cached profile of another method is measured again
PROFILED = {"prfaas": ("H200", "prefill"), "local_prefill": ("H20", "prefill"), "decode": ("H20", "decode")}


def generate(url: str, ids: list[int], out_tokens: int) -> None:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": out_tokens, "ignore_eos": True,
                                                  "temperature": 0}}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def makespan(url: str, prompts: list[list[int]], out_tokens: int) -> float:
    """Seconds from sending every prompt at once to the last answer."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda ids: generate(url, ids, out_tokens), prompts))
    return time.monotonic() - t0


def prompts(rng: random.Random, n: int, length: int, vocab: int = 512) -> list[list[int]]:
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


def prefill_curve(url: str, rng: random.Random) -> dict:
    secs = [makespan(url, prompts(rng, CONCURRENCY, n), 1) / CONCURRENCY for n in PREFILL_LENGTHS]
    return {"tokens": list(PREFILL_LENGTHS), "s_per_request": secs,
            "tokens_per_s": [n / s for n, s in zip(PREFILL_LENGTHS, secs)]}


def decode_step(url: str, rng: random.Random) -> dict:
    short = makespan(url, prompts(rng, DECODE_BATCH, 32), 1)
    long = makespan(url, prompts(rng, DECODE_BATCH, 32), DECODE_TOKENS)
    step = max(long - short, 1e-3) / (DECODE_TOKENS - 1)
    return {"batch": DECODE_BATCH, "step_s": step, "tokens_per_s": DECODE_BATCH / step}


def cache_key(model: str, shared: bool) -> dict:
    return {"version": VERSION, "model": Path(model).name, "reference_cores": hardware.REFERENCE_CORES,
            "shares": {pool: hardware.pool_share(pool).cores if shared else None for pool in PROFILED}}


def measure(model: str, log_path: Path, say, shared: bool = True) -> dict:
    """Start one colocated server pinned to the remote core, then measure each pool's kind under its share
    (`shared` False: the demo's fallback without shares, every kind on one unshared server)."""
    spec = ServerSpec(model_path=model, port=free_port(), log_path=str(log_path),
                      extra_args=("--prfaas-role", "local"), cpu=hardware.pool_share("prfaas") if shared else None)
    rng, doc = random.Random(0), {}
    with SGLangServer(spec) as srv:
        generate(srv.url, prompts(rng, 1, 64)[0], 4)  # warm-up: first-call allocations and caches
        for pool, (kind, role) in PROFILED.items():
            cores = hardware.pool_share(pool).cores if shared else None
            if shared:
                srv.cpu.set_cores(cores)
            doc[pool] = {"kind": kind, "role": role, "cores": cores,
                         **(prefill_curve(srv.url, rng) if role == "prefill" else decode_step(srv.url, rng))}
            say(f"profile {pool} ({kind} {role}, {cores or 'unshared'} cores): {summary(doc[pool])}")
    return doc


def summary(entry: dict) -> str:
    if "step_s" in entry:
        return f"decode step {entry['step_s'] * 1000:.0f} ms at batch {entry['batch']}"
    return "prefill " + ", ".join(f"{n} tok {s:.2f} s/req" for n, s in zip(entry["tokens"], entry["s_per_request"]))


def load_or_measure(model: str, cache: Path, log_path: Path, say, shared: bool = True) -> dict:
    """The cached profile when its key matches, else a fresh measurement (written to `cache`)."""
    key = cache_key(model, shared)
    if cache.is_file():
        doc = json.loads(cache.read_text())
        if doc.get("key") == key:
            say(f"profile: cached in {cache} (delete it to measure again)")
            for pool in PROFILED:
                say(f"profile {pool}: {summary(doc['pools'][pool])}")
            return doc["pools"]
    say("profiling each emulated kind on one server (~2 min; cached afterwards) ...")
    pools = measure(model, log_path, say, shared)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "pools": pools, "measured": time.strftime("%Y-%m-%d %H:%M:%S")},
                                indent=1))
    return pools
