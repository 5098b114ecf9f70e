"""The demo's profiling step: each emulated kind's prefill curve and decode rate on the tiny model, and what
the KV handoff costs, measured on one PD pair (pair.py: a prefill and a decode over prfaas_zmq with the demo's
CURVE keys) whose prefill's CPU share is switched between the kinds (hardware.py), then cached.

    prefill: CONCURRENCY requests of L random tokens, 1 output token, at once  ->  s/request = makespan / n
             (through the pair: the prefill's time includes sending the KV, as in the demo)
    handoff: per batch, the decode's CPU seconds / n (less its idle rate)        ->  receive CPU s/request at L
             and the prefill transport's wire bytes / n                        ->  S_kv(L) as it crosses a link
    decode:  DECODE_BATCH requests, DECODE_TOKENS outputs vs 1 output          ->  step = Δmakespan / (tokens-1)

Seconds per request under concurrency, not one request's latency: the planner's Θ = n / T(l) is what an
instance sustains, and SGLang batches concurrent prefills. Every prompt is fresh random ids, so no prefix
cache hit shortens a measurement. The cache key holds what the numbers depend on (model, shares, method).
A colocated profile (the method before the pair) measured no handoff: the prefill never sent its KV and the
decode step excluded receiving it, so the planner over-predicted every PD configuration (measured 58-71 %).
"""
from __future__ import annotations

import json
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prfaas_sgl.tools.demo import hardware
from prfaas_sgl.tools.demo.pair import Pair

PREFILL_LENGTHS = (32, 256, 1024)  # tokens; the scaled paper workload lies in [2, 2048], mean ~420
CONCURRENCY = 4
DECODE_BATCH, DECODE_TOKENS = 8, 17
VERSION = 2  # bump when the method changes: a cached profile of another method is measured again
IDLE_S = 2.0  # the decode's idle CPU rate is measured over this long and subtracted from its batches
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


def prefill_curve(pair: Pair, rng: random.Random, idle_rate: float) -> dict:
    """The prefill curve through the pair, with each side's CPU and the wire bytes per request (the prefill's
    CPU is its whole share's work, compute and sending; the decode's is the receiving side alone)."""
    secs, send, recv, wire = [], [], [], []
    for n in PREFILL_LENGTHS:
        before = pair.counters()
        span = makespan(pair.url, prompts(rng, CONCURRENCY, n), 1)
        after = pair.counters()
        secs.append(span / CONCURRENCY)
        send.append((after[0] - before[0]) / CONCURRENCY)
        recv.append(max(after[1] - before[1] - idle_rate * span, 0.0) / CONCURRENCY)
        wire.append((after[2] - before[2]) / CONCURRENCY)
    return {"tokens": list(PREFILL_LENGTHS), "s_per_request": secs,
            "tokens_per_s": [n / s for n, s in zip(PREFILL_LENGTHS, secs)],
            "prefill_cpu_s": send, "decode_recv_cpu_s": recv, "wire_bytes": wire}


def idle_cpu_rate(pair: Pair) -> float:
    """The decode's CPU seconds per second while nothing runs (its scheduler parks; a residue remains)."""
    before = pair.counters()[1]
    time.sleep(IDLE_S)
    return (pair.counters()[1] - before) / IDLE_S


def decode_step(url: str, rng: random.Random) -> dict:
    """The decode step through the pair: receiving the KV cancels out of Δmakespan (handoff: the curves)."""
    short = makespan(url, prompts(rng, DECODE_BATCH, 32), 1)
    long = makespan(url, prompts(rng, DECODE_BATCH, 32), DECODE_TOKENS)
    step = max(long - short, 1e-3) / (DECODE_TOKENS - 1)
    return {"batch": DECODE_BATCH, "step_s": step, "tokens_per_s": DECODE_BATCH / step}


def cache_key(model: str, shared: bool) -> dict:
    return {"version": VERSION, "model": Path(model).name, "reference_cores": hardware.REFERENCE_CORES,
            "method": "pd pair over prfaas_zmq, curve keys",
            "shares": {pool: hardware.pool_share(pool).cores if shared else None for pool in PROFILED}}


def measure(model: str, log_path: Path, say, shared: bool = True, keys_dir: str | None = None,
            model_ref: str = "tiny:tiny-qwen35-hybrid") -> dict:
    """Start the PD pair, the prefill pinned to the remote core, then measure each pool's kind under its share
    (`shared` False: the demo's fallback without shares, every kind on unshared servers)."""
    rng, doc = random.Random(0), {}
    with Pair(model_ref, model, keys_dir, shared, log_path.parent / "profile", say) as pair:
        generate(pair.url, prompts(rng, 1, 64)[0], 4)  # warm-up: first-call allocations, the pair's handshake
        idle = idle_cpu_rate(pair)
        for pool, (kind, role) in PROFILED.items():
            cores = hardware.pool_share(pool).cores if shared else None
            if shared:  # the decode's batches run behind the fastest prefill kind, as in the demo's PrfaaS runs
                pair.server("local-prefill-0").cpu.set_cores(cores if role == "prefill" else
                                                             hardware.pool_share("prfaas").cores)
            entry = (prefill_curve(pair, rng, idle) if role == "prefill"
                     else decode_step(pair.url, rng) | {"idle_cpu_rate": idle})
            doc[pool] = {"kind": kind, "role": role, "cores": cores, **entry}
            say(f"profile {pool} ({kind} {role}, {cores or 'unshared'} cores): {summary(doc[pool])}")
    return doc


def summary(entry: dict) -> str:
    if "step_s" in entry:
        return f"decode step {entry['step_s'] * 1000:.0f} ms at batch {entry['batch']}"
    line = "prefill " + ", ".join(f"{n} tok {s:.2f} s/req" for n, s in zip(entry["tokens"], entry["s_per_request"]))
    if "decode_recv_cpu_s" in entry:
        line += "; handoff: decode receive " + ", ".join(f"{1000 * c:.0f} ms" for c in entry["decode_recv_cpu_s"]) \
            + " CPU/req, wire " + ", ".join(f"{b / 1000:.0f} kB" for b in entry["wire_bytes"]) + "/req"
    return line


def load_or_measure(model: str, cache: Path, log_path: Path, say, shared: bool = True,
                    keys_dir: str | None = None) -> dict:
    """The cached profile when its key matches, else a fresh measurement (written to `cache`)."""
    key = cache_key(model, shared)
    if cache.is_file():
        doc = json.loads(cache.read_text())
        if doc.get("key") == key:
            say(f"profile: cached in {cache} (delete it to measure again)")
            for pool in PROFILED:
                say(f"profile {pool}: {summary(doc['pools'][pool])}")
            return doc["pools"]
    say("profiling each emulated kind on a PD pair (~2-3 min; cached afterwards) ...")
    pools = measure(model, log_path, say, shared, keys_dir)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "pools": pools, "measured": time.strftime("%Y-%m-%d %H:%M:%S")},
                                indent=1))
    return pools
