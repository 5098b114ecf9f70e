"""Router overhead benchmark: our router vs SGLang's mini_lb and Rust PD router, same stand-in backends.

All three routers sit in front of the same stand-in prefill + decode pair (tests/support/router_standin.py, one
separate process). For each target we measure, with a seeded open-loop Poisson load at ``--rate`` req/s, latency
percentiles; "added" latency = target percentile - direct percentile, where "direct" is the client doing the
PD fan-out itself (prefill + decode posted concurrently, no router). Then a closed loop at
``--concurrency`` gives the max req/s. Writes out/bench_router.json and prints markdown rows.

    python3 scripts/bench_router.py --requests 2000 --rate 200 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the stand-ins are test support, not installed
from tests.support.router_standin import RoomBoard, Standin, build_tiny_tokenizer  # noqa: E402

BODY = {"model": "tiny", "prompt": "hello world, how are you today?", "max_tokens": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def serve_standins(pre_port: int, dec_port: int) -> None:
    board = RoomBoard()
    pre = Standin("prefill", board, keep_bodies=False)
    dec = Standin("decode", board, keep_bodies=False)
    await pre.start(port=pre_port)
    await dec.start(port=dec_port)
    await asyncio.Event().wait()


def router_cmds(pre: str, dec: str, port: int, tok: str) -> dict[str, list[str]]:
    py = sys.executable
    sgl = [py, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--host", "127.0.0.1",
           "--port", str(port), "--prefill", pre, "8998", "--decode", dec]
    return {
        "prfaas_sgl": [py, "-m", "prfaas_sgl.launch_router", "--port", str(port), "--local-prefill",
                       f"{pre};bootstrap=8998", "--decode", dec, "--tokenizer-path", tok,
                       "--served-model-name", "tiny", "--policy", "threshold", "--log-level", "warning"],
        "sglang_mini_lb": sgl + ["--mini-lb", "--log-level", "warn"],
        "sglang_rust_pd": sgl + ["--log-level", "warn"],
    }


async def wait_ready(session: aiohttp.ClientSession, url: str, timeout_s: float = 60, path: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            req = session.get(url + path) if path else session.post(url + "/v1/completions", json=BODY)
            async with req as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.25)
    raise RuntimeError(f"{url} not ready after {timeout_s}s")


async def one(session: aiohttp.ClientSession, url: str, direct: tuple[str, str] | None, rng: random.Random) -> float:
    t0 = time.perf_counter()
    if direct is None:
        async with session.post(url + "/v1/completions", json=BODY) as r:
            await r.read()
            assert r.status == 200, r.status
    else:
        body = dict(BODY, bootstrap_host="127.0.0.1", bootstrap_port=8998, bootstrap_room=rng.getrandbits(63))

        async def post(u: str) -> None:
            async with session.post(u + "/v1/completions", json=body) as r:
                await r.read()
        await asyncio.gather(post(direct[0]), post(direct[1]))
    return time.perf_counter() - t0


async def open_loop(session, url, direct, n: int, rate: float, seed: int) -> np.ndarray:
    rng = random.Random(seed)
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))
    tasks, start = [], time.perf_counter()
    for i in range(n):
        delay = start + arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(session, url, direct, rng)))
    return np.array(await asyncio.gather(*tasks))


async def closed_loop(session, url, direct, n: int, conc: int, seed: int) -> float:
    rng, left = random.Random(seed), [n]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            await one(session, url, direct, rng)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return n / (time.perf_counter() - t0)


async def measure(name, url, direct, args) -> dict:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        if direct is None:
            await wait_ready(s, url)
        await open_loop(s, url, direct, args.warmup, args.rate, args.seed + 1)
        lat = await open_loop(s, url, direct, args.requests, args.rate, args.seed)
        rps = await closed_loop(s, url, direct, args.requests, args.concurrency, args.seed)
    p50, p99 = np.percentile(lat, [50, 99]) * 1e3
    return {"target": name, "p50_ms": float(p50), "p99_ms": float(p99), "max_rps": rps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--rate", type=float, default=200.0, help="open-loop req/s for the latency run")
    ap.add_argument("--concurrency", type=int, default=32, help="closed-loop clients for max req/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--targets", default="prfaas_sgl,sglang_mini_lb,sglang_rust_pd")
    ap.add_argument("--out", default="out/bench_router.json")
    ap.add_argument("--serve-standins", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_standins:
        uvloop.run(serve_standins(*args.serve_standins))
        return
    uvloop.run(run_all(args))


async def run_all(args) -> None:
    pre_port, dec_port, r_port = free_port(), free_port(), free_port()
    pre, dec = f"http://127.0.0.1:{pre_port}", f"http://127.0.0.1:{dec_port}"
    procs = [subprocess.Popen([sys.executable, __file__, "--serve-standins", str(pre_port), str(dec_port)])]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(tempfile.mkdtemp(prefix="bench_router_tok_"))
    results = []
    try:
        async with aiohttp.ClientSession() as s:
            await wait_ready(s, pre, path="/health")
            await wait_ready(s, dec, path="/health")
        results.append(await measure("direct (no router)", None, (pre, dec), args))
        for name, cmd in router_cmds(pre, dec, r_port, tok).items():
            if name not in args.targets.split(","):
                continue
            log = open(Path(args.out).with_name(f"bench_router_{name}.log"), "w")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                results.append(await measure(name, f"http://127.0.0.1:{r_port}", None, args))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)
    report(results, args)


def report(results: list[dict], args) -> None:
    base = results[0]
    for r in results[1:]:
        r["added_p50_ms"] = r["p50_ms"] - base["p50_ms"]
        r["added_p99_ms"] = r["p99_ms"] - base["p99_ms"]
    meta = {k: v for k, v in vars(args).items() if k != "serve_standins"}
    meta.update(cpus=os.cpu_count(), python=sys.version.split()[0])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": meta, "results": results}, indent=2))
    print(f"\nrate={args.rate} req/s open loop, {args.requests} requests, concurrency={args.concurrency}, "
          f"{os.cpu_count()} CPUs\n")
    print("| target | p50 ms | p99 ms | added p50 ms | added p99 ms | max req/s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['target']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r.get('added_p50_ms', 0):.2f} | "
              f"{r.get('added_p99_ms', 0):.2f} | {r['max_rps']:.0f} |")


if __name__ == "__main__":
    main()
