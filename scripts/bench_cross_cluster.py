"""Loading a cached prefix from the shared store across the inter-DC link vs recomputing it: measured at two
`tc tbf` rates, and the crossover the router's cost model predicts (router/cost.price_fetch) vs the measured one.

    remote DC (netns)  publisher: a Mooncake client holding the prefix's entries in its segment
    local DC  (host)   mooncake_master; reader: a Mooncake client loading them as a prefill's tiers do
                       (per checkpoint interval: exists + get of the KV block, exists + get of the state)
    link               veth + tbf at --rates (tools/netns.py): every loaded byte crosses it

    fetch_s(L)    the reader's wall time for the entries of an L-token prefix (tiny GDN sizes: 64-token
                  blocks, a KV entry and a state entry per block, the sizes docs/cachepool-tiers.md gives)
    saved_s(L)    what recomputing L tokens costs on a colocated CPU SGLang server (tiny-qwen35-hybrid, chunk
                  64, no prefix cache): TTFT(L + 64) - TTFT(64), max_new_tokens 1, median of --reps
    predicted     price_fetch at the link's goodput (rate x 0.956, link-emulation.md), --fetch-rtt-s per
                  interval, KV/state bytes the router derives from the model (--model-path), local prefill
                  fit a + b l + c l^2 to the fastest measured TTFTs (what the router's --local-prefill-coef would hold)
    crossover     the prefix length from which loading beats recomputing (none: one side wins everywhere)

    .venv/bin/python scripts/bench_cross_cluster.py --rates 10mbit,100mbit --lengths 256,1024,2048,4096 \\
        --reps 3 --out docs/results/bench_cross_cluster.json          (root: namespaces, tc)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prfaas_sgl.cachepool.tiers.entry import entry_size  # noqa: E402
from prfaas_sgl.cachepool.tiers.master import MooncakeMaster, free_port  # noqa: E402
from prfaas_sgl.router.config import model_costs  # noqa: E402
from prfaas_sgl.router.cost import ModelCost, price_fetch  # noqa: E402
from prfaas_sgl.tools import netns  # noqa: E402
from prfaas_sgl.tools.launch import SGLangServer, ServerSpec  # noqa: E402
from prfaas_sgl.tools.launch import free_port as http_port  # noqa: E402
from prfaas_sgl.tools.models.tiny import ensure  # noqa: E402
from tests.sglang.pd import generate_body, post  # noqa: E402
from tests.sglang.prompts import prompt_ids  # noqa: E402

MODEL = "tiny-qwen35-hybrid"
GRID = 64  # tokens per block = per checkpoint interval (chunk 64)
KV_ENTRY, STATE_ENTRY = entry_size(32_768), entry_size(33_792)  # one tier entry (docs/cachepool-tiers.md)
GOODPUT = 0.956  # tbf goodput ceiling (1448 payload bytes per 1514-byte frame)
EXT = 64  # the increment a prefill computes after the prefix

PUBLISHER = r"""
import sys
from prfaas_sgl.cachepool.tiers.storage import MooncakeStoreBackend
master, host = sys.argv[1], sys.argv[2]
store = MooncakeStoreBackend(master, local_host=host, segment_bytes=512 << 20)
for item in sys.argv[3:]:
    tag, n = item.split(":")
    for i in range(int(n)):
        assert store.put(f"{tag}-kv-{i}", bytes([i % 251]) * KV) and store.put(f"{tag}-st-{i}", bytes([i % 241]) * ST)
print("ready", flush=True)
sys.stdin.read()  # hold the segment until the reader is done
""".replace("KV", str(KV_ENTRY)).replace("ST", str(STATE_ENTRY))


def start_master(ip: str) -> subprocess.Popen:
    binary = MooncakeMaster().binary
    port = free_port()
    proc = subprocess.Popen([binary, f"--rpc_port={port}", f"--rpc_address={ip}", f"--metrics_port={free_port()}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc.addr = f"{ip}:{port}"  # type: ignore[attr-defined]
    time.sleep(1.0)
    return proc


def load(store, tag: str, intervals: int) -> float:
    """Seconds to load `intervals` checkpoint intervals the way a prefill's tiers do (plan, then get)."""
    t0 = time.perf_counter()
    for i in range(intervals):
        assert store.exists(f"{tag}-kv-{i}") and store.exists(f"{tag}-st-{i}")
    for i in range(intervals):
        kv, st = store.get(f"{tag}-kv-{i}", KV_ENTRY), store.get(f"{tag}-st-{i}", STATE_ENTRY)
        assert kv is not None and len(kv) == KV_ENTRY and st is not None and len(st) == STATE_ENTRY
    return time.perf_counter() - t0


def fetch_side(rate: str, lengths: list[int], reps: int) -> dict[int, list[float]]:
    """fetch_s per prefix length over a fresh tbf link at `rate`; each rep loads entries it never loaded."""
    from prfaas_sgl.cachepool.tiers.storage import MooncakeStoreBackend

    out: dict[int, list[float]] = {n: [] for n in lengths}
    with netns.emulated_link(rate) as link:
        master = start_master(link.local_ip)
        pub = None
        try:
            pub = publish(link, master.addr, [f"p{n}r{r}:{n // GRID}" for n in lengths for r in range(reps)])
            reader = MooncakeStoreBackend(master.addr, local_host=link.local_ip, segment_bytes=16 << 20)
            for n in lengths:
                for r in range(reps):
                    out[n].append(load(reader, f"p{n}r{r}", n // GRID))
            reader.close()
        finally:
            if pub is not None:
                pub.kill()
            master.kill()
            master.wait()
    return out


def publish(link: netns.Link, master: str, items: list[str]) -> subprocess.Popen:
    """A publisher in the remote namespace putting every ``tag:intervals`` item; returns once they are in the
    store. The reader mounts its segment only after that, so every entry lives in the publisher's segment
    and every load crosses the link."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(link.exec_prefix + [sys.executable, "-c", PUBLISHER, master, link.remote_ip, *items],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                            text=True)
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"publisher failed (exit {proc.poll()})")
    return proc


def recompute_side(lengths: list[int], reps: int, log_dir: Path) -> dict[int, list[float]]:
    """TTFT (max_new_tokens 1) of fresh prompts of n tokens on a colocated no-cache server, n in lengths + EXT."""
    spec = ServerSpec(model_path=str(ensure(MODEL)), port=http_port(), log_path=str(log_dir / "xc_recompute.log"),
                      chunked_prefill_size=GRID, max_running_requests=1, extra_args=("--disable-radix-cache",))
    srv = SGLangServer(spec).start()
    out: dict[int, list[float]] = {}
    try:
        srv.wait_healthy(timeout_s=600)
        post(spec.url + "/generate", generate_body(prompt_ids(spec.model_path, 64, seed=1), 1))  # warm-up
        for n in sorted({EXT, *(x + EXT for x in lengths)}):
            out[n] = []
            for r in range(reps):
                ids = prompt_ids(spec.model_path, n, seed=5000 + 97 * r + n)
                t0 = time.perf_counter()
                assert "output_ids" in post(spec.url + "/generate", generate_body(ids, 1))
                out[n].append(time.perf_counter() - t0)
    finally:
        srv.stop()
    return out


def fit(ttft: dict[int, list[float]]) -> tuple[float, float, float]:
    """Least-squares a + b n + c n^2 (c >= 0) through the fastest TTFT of each length (the least disturbed by
    other jobs on the machine)."""
    n = np.array(sorted(ttft), dtype=float)
    y = np.array([min(ttft[int(k)]) for k in n])
    a, b, c = np.linalg.lstsq(np.stack([np.ones_like(n), n, n * n], 1), y, rcond=None)[0]
    return float(a), float(b), float(max(c, 0.0))


def crossover(lengths: list[int], gain: list[float]) -> float | None:
    """First prefix length where gain (saved - fetch) turns positive, linearly interpolated; None if it
    never changes sign on the grid (one side wins at every length measured)."""
    for (l0, g0), (l1, g1) in zip(zip(lengths, gain), zip(lengths[1:], gain[1:])):
        if g0 <= 0 < g1:
            return l0 + (l1 - l0) * (-g0) / (g1 - g0)
    return None


def predict(cost: ModelCost, rate_bps: float, rtt_s: float, lengths: list[int]) -> dict:
    """The router's view: price_fetch for a prefill holding nothing, loading an L-token prefix."""
    fine = list(range(GRID, max(lengths) + 1, GRID))
    priced = [price_fetch(cost, False, n + EXT, 0, n, GRID, rtt_s, rate_bps) for n in fine]
    at = {n: price_fetch(cost, False, n + EXT, 0, n, GRID, rtt_s, rate_bps) for n in lengths}
    # the first block-aligned length from which loading pays (GRID: from the first block; None: never)
    return {"crossover_tokens": next((n for n, f in zip(fine, priced) if f.pays), None),
            "fetch_s": {n: f.fetch_s for n, f in at.items()}, "saved_s": {n: f.saved_s for n, f in at.items()}}


def break_even_mbit(cost: ModelCost, rtt_s: float, n: int, saved_s: float) -> float | None:
    """The link goodput (Mbit/s) above which the router prices loading n tokens below recomputing them."""
    f = price_fetch(cost, False, n + EXT, 0, n, GRID, 0.0, 1.0)
    spare = saved_s - f.intervals * rtt_s
    return f.nbytes * 8 / spare / 1e6 if spare > 0 else None


def rate_bps(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, k in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * k
    raise ValueError(f"rate {rate!r}: use e.g. 10mbit")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="10mbit,100mbit")
    ap.add_argument("--lengths", default="256,1024,2048,4096", help="prefix tokens (multiples of 64)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fetch-rtt-s", type=float, default=0.002, help="the router's --fetch-rtt-s for the prediction")
    ap.add_argument("--out", default="out/bench_cross_cluster.json")
    ap.add_argument("--log-dir", default="out/bench_cross_cluster_logs")
    args = ap.parse_args()
    lengths = sorted(int(x) for x in args.lengths.split(","))
    if any(n % GRID for n in lengths):
        ap.error(f"--lengths must be multiples of {GRID}")
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    result = run(args.rates.split(","), lengths, args.reps, args.fetch_rtt_s, Path(args.log_dir))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))


def run(rates: list[str], lengths: list[int], reps: int, rtt_s: float, log_dir: Path) -> dict:
    t0, load = time.time(), os.getloadavg()
    ttft = recompute_side(lengths, reps, log_dir)
    coef = fit(ttft)
    # medians, and the fastest of the reps: on a machine shared with other jobs the fastest is the least disturbed
    saved = {n: statistics.median(ttft[n + EXT]) - statistics.median(ttft[EXT]) for n in lengths}
    saved_min = {n: min(ttft[n + EXT]) - min(ttft[EXT]) for n in lengths}
    acct = model_costs(str(ensure(MODEL)))
    cost = ModelCost(acct["kv_bytes_per_token"], acct["state_bytes"], local_coef=coef)
    summary: dict = {"break_even_mbit": {n: {"predicted": break_even_mbit(cost, rtt_s, n, cost.prefill_s_local(n + EXT)
                                                                      - cost.prefill_s_local(EXT))} for n in lengths}}
    raw = {}
    for rate in rates:
        fetched = fetch_side(rate, lengths, reps)
        fetch = {n: statistics.median(v) for n, v in fetched.items()}
        fetch_min = {n: min(v) for n, v in fetched.items()}
        pred = predict(cost, rate_bps(rate) * GOODPUT, rtt_s, lengths)
        summary[rate] = {"fetch_s": fetch, "saved_s": saved, "fetch_s_min": fetch_min, "saved_s_min": saved_min,
                         "predicted": pred,
                         "measured_crossover_tokens": crossover(lengths, [saved[n] - fetch[n] for n in lengths]),
                         "loading_wins_at": [n for n in lengths if fetch[n] < saved[n]],
                         "loading_wins_at_min": [n for n in lengths if fetch_min[n] < saved_min[n]]}
        raw[rate] = fetched
        for n in lengths:  # the transfer scales as 1/rate: the rate at which this fetch would take saved_s
            summary["break_even_mbit"][n][f"measured_at_{rate}"] = rate_bps(rate) * GOODPUT * fetch[n] / saved[n] / 1e6
    return {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "wall_s": time.time() - t0,
            "load_before": load, "load_after": os.getloadavg(), "lengths": lengths, "reps": reps, "fetch_rtt_s": rtt_s,
            "entry_bytes": {"kv": KV_ENTRY, "state": STATE_ENTRY}, "router_cost": {**acct, "local_coef": coef},
            "ttft_s": ttft, "fetch_raw_s": raw, "summary": summary}


if __name__ == "__main__":
    main()
