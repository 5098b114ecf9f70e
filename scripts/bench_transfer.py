"""Benchmark the ZeroMQ KV data plane against Mooncake's TCP transfer engine (not a test).

Two processes per transport (scripts/bench_transfer_worker.py), on two paths:
  loopback   both on 127.0.0.1 (CPU-bound here: compare interleaved repetitions)
  1gbit/5gbit  sender (PrfaaS prefill) in a network namespace, receiver (decode) on the host, veth + tc tbf
               (prfaas_sgl/tools/netns.py; needs root, skipped with a message otherwise; always removed).
  tcp          plain one-connection TCP in the same run: the ceiling of the path under the current load.
Payloads: `hybrid` (1T Kimi-Linear-like request, 8K tokens ≈ 307 MiB) and `dense` (GQA, ≈ 282 MiB).
Reports goodput (Gbit/s, fraction of the tbf rate), CPU s/GB on both ends, CURVE on/off, 1-8 connections.

    python3 scripts/bench_transfer.py --paths loopback 1gbit 5gbit --reps 2 --out out/bench_transfer
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prfaas_sgl.tools import netns  # noqa: E402
from bench_transfer_worker import Payload  # noqa: E402

from prfaas_sgl.transfer.security import generate_keys  # noqa: E402

MIB = 1 << 20
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_transfer_worker.py")


def cases(payload: str) -> list[dict]:
    """Zmq cases (connections, chunk, CURVE) plus Mooncake; the hybrid payload gets the full sweep."""
    def z(c: int, k: float = 1, curve: bool = False, window_mib: int = 32) -> dict:
        return {"transport": "zmq", "connections": c, "chunk_bytes": int(k * MIB), "curve": curve,
                "window_bytes": window_mib * MIB}
    mc = {"transport": "mooncake", "connections": 0, "chunk_bytes": 0, "curve": False, "window_bytes": 0}
    tcp = {**mc, "transport": "tcp", "connections": 1}
    if payload == "dense":
        return [tcp, z(4), z(4, curve=True), mc]
    return [tcp, z(1), z(2), z(4), z(8), z(4, 0.25), z(4, 4), z(4, window_mib=128), z(1, curve=True),
            z(4, curve=True), mc]


class Worker:
    """A worker subprocess speaking one JSON line per command."""

    def __init__(self, prefix: list[str], role: str, payload: str, host: str, keys_dir: str | None) -> None:
        cmd = prefix + [sys.executable, WORKER, "--role", role, "--payload", payload, "--host", host]
        cmd += ["--keys-dir", keys_dir] if keys_dir else []
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.hello = self._read()

    def __call__(self, op: str, **kw: object) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait(10)}")
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self("quit")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()


def run_case(case: dict, tid: int, w: dict[str, Worker]) -> dict:
    if case["transport"] == "zmq":
        rx, tx = w["zmq-recv"], w["zmq-send"]
        peer = rx.hello["curve" if case["curve"] else "plain"]
        rx("mark")
        rx("expect", tid=tid, curve=case["curve"])
        res = tx("send", tid=tid, peer=peer, connections=case["connections"], curve=case["curve"],
                 chunk_bytes=case["chunk_bytes"], window_bytes=case["window_bytes"])
        got = rx("wait", tid=tid, curve=case["curve"])
    else:
        prefix = {"mooncake": "mc", "tcp": "tcp"}[case["transport"]]
        rx, tx = w[f"{prefix}-recv"], w[f"{prefix}-send"]
        rx("mark")
        if prefix == "tcp":
            rx("expect", tid=tid, curve=False)
        res = tx("send", tid=tid, peer=rx.hello)
        got = rx("wait", tid=tid, curve=False)
    rx_cpu = rx("cpu")["cpu"]
    match = got["digest"] == res["digest"]
    return {**res, "recv_cpu": rx_cpu, "recv_state": got["state"], "bytes_match": match}


def bench_path(path: str, payloads: list[str], reps: int, keys_dir: str, mooncake: bool) -> list[dict]:
    rate = {"loopback": None, "1gbit": 1.0, "5gbit": 5.0}[path]
    link_ctx = netns.emulated_link(path) if rate else contextlib.nullcontext()
    rows = []
    with link_ctx as link:
        prefix = link.exec_prefix if link else []
        rx_host, tx_host = (link.local_ip, link.remote_ip) if link else ("127.0.0.1", "127.0.0.1")
        for payload in payloads:
            nbytes = Payload.named(payload).nbytes
            roles = {"zmq-recv": ([], rx_host), "zmq-send": (prefix, tx_host), "tcp-recv": ([], rx_host),
                     "tcp-send": (prefix, tx_host)}
            if mooncake:
                roles |= {"mc-recv": ([], rx_host), "mc-send": (prefix, tx_host)}
            workers = {r: Worker(pre, r, payload, host, keys_dir) for r, (pre, host) in roles.items()}
            try:
                todo = [c for c in cases(payload) if mooncake or c["transport"] != "mooncake"]
                for i, case in enumerate(todo):  # untimed warm-up: connections, handshakes, first touch
                    run_case(case, 900_000 + i, workers)
                for rep in range(reps):  # interleaved: every case once per repetition
                    for i, case in enumerate(todo):
                        r = run_case(case, 1000 * rep + i + 1, workers)
                        rows.append(_row(path, rate, payload, nbytes, rep, case, r))
                        print(json.dumps(rows[-1]), flush=True)
            finally:
                for wk in workers.values():
                    wk.close()
    return rows


def _row(path: str, rate: float | None, payload: str, nbytes: int, rep: int, case: dict, r: dict) -> dict:
    gbps = nbytes * 8 / r["wall"] / 1e9
    return {"path": path, "payload": payload, "bytes": nbytes, "rep": rep, **case, "state": r["state"],
            "recv_state": r["recv_state"], "bytes_match": r["bytes_match"], "wall_s": r["wall"],
            "goodput_gbps": gbps, "link_fraction": gbps / rate if rate else None,
            "send_cpu_s_per_gb": r["cpu"] / (nbytes / 1e9),
            "recv_cpu_s_per_gb": r["recv_cpu"] / (nbytes / 1e9)}


def table(rows: list[dict]) -> str:
    """Markdown table: goodput median [min–max] over repetitions (spread = machine contention), CPU mean."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["path"], r["payload"], r["transport"], r["connections"], r["chunk_bytes"], r["curve"],
               r["window_bytes"])
        groups.setdefault(key, []).append(r)
    out = ["| path | payload | transport | conns | chunk | window | CURVE | goodput Gbit/s, median [min–max] "
           "| of link | send CPU s/GB | recv CPU s/GB | reps | bytes ok |", "|" + "---|" * 13]
    for (path, payload, tr, c, k, curve, win), rs in groups.items():
        mean = lambda f: sum(x[f] for x in rs) / len(rs)
        spread = lambda f: f"{statistics.median(x[f] for x in rs):.2f} [{min(x[f] for x in rs):.2f}–" \
                           f"{max(x[f] for x in rs):.2f}]"
        frac = spread("link_fraction") if rs[0]["link_fraction"] else "–"
        chunk = f"{k // 1024} KiB" if k else "–"
        out.append(f"| {path} | {payload} | {tr} | {c or '–'} | {chunk} | "
                   f"{f'{win // MIB} MiB' if win else '–'} | {'on' if curve else 'off'} | "
                   f"{spread('goodput_gbps')} | {frac} | "
                   f"{mean('send_cpu_s_per_gb'):.2f} | {mean('recv_cpu_s_per_gb'):.2f} | {len(rs)} | "
                   f"{all(x['bytes_match'] and x['state'] == 'done' for x in rs)} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--paths", nargs="+", default=["loopback", "1gbit", "5gbit"],
                    choices=["loopback", "1gbit", "5gbit"])
    ap.add_argument("--payloads", nargs="+", default=["hybrid", "dense"], choices=["hybrid", "dense"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument("--out", default="out/bench_transfer")
    ap.add_argument("--table-only", action="store_true", help="re-render OUT.md from OUT.json, run nothing")
    a = ap.parse_args()
    if a.table_only:
        with open(a.out + ".json") as f:
            data = json.load(f)
        _write_md(a.out, data["meta"]["argv"], table(data["rows"]))
        return
    paths = list(a.paths)
    problem = netns.root_problem()
    if problem and any(p != "loopback" for p in paths):
        print(f"SKIP emulated links: {problem}", file=sys.stderr)
        paths = [p for p in paths if p == "loopback"]
    mooncake = not a.no_mooncake and _has_mooncake()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="prfaas-keys-") as keys:
        generate_keys(keys)
        for path in paths:
            rows += bench_path(path, a.payloads, a.reps, keys, mooncake)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    meta = {"argv": sys.argv, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpus": os.cpu_count()}
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    _write_md(a.out, sys.argv, table(rows))


def _write_md(out: str, argv: list[str], md: str) -> None:
    with open(out + ".md", "w") as f:
        f.write(f"`python3 {' '.join(argv)}`\n\n{md}\n")
    print(md)


def _has_mooncake() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        print(f"mooncake not importable ({e}); pip install mooncake-transfer-engine-non-cuda and apt-get "
              "install libibverbs1 to compare", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    main()
