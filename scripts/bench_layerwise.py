"""Prefill-as-a-Service TTFT on real SGLang servers (CPU, tiny models), every KV path side by side over one
emulated inter-datacenter link: chunk-pipelined, layer-wise and optimistic prfaas_zmq, and SGLang's own
`--disaggregation-transfer-backend mooncake` (its TCP transfer engine, MC_FORCE_TCP).

The link is tools/link_delay's: the prefill servers run in a network namespace reached through two TUN
devices with `tc tbf` on both (the rate) and a userspace delay line between them (the round trip; this
kernel has no netem), so every packet between the datacenters, control and data, pays rate and delay.
The decodes, the colocated server and this client (the router) are on the host, in the local datacenter.

    chunk       prfaas_zmq, KV sent per chunked-prefill chunk
    layerwise   prfaas_zmq with --prfaas-layerwise-layers-per-group (every request streams per layer group)
    optimistic  chunk + SGLang's --optimistic-prefill-attempts 1: the prefill starts before the decode's
                bootstrap handshake arrives (the round trips it hides exist only with RTT > 0)
    mooncake    SGLang's mooncake backend over TCP, its own prefill and decode, pinned to the link's
                addresses with SGLANG_HOST_IP

Per link rate, RTT and prompt length, one request at a time, a fresh prompt each time (nothing cached):

    TTFT      client -> decode answer with max_new_tokens=1, timed on TCP connections opened beforehand
              (a router keeps a warm pool: the timing holds the link's round trips SGLang itself makes,
              not this client's TCP handshakes)
    tail      TTFT - the colocated server's TTFT for the same prompt (same chunked prefill, no transfer,
              no link): the time from the prompt's last forward to the decode's first token plus what the
              round trips add; what layer-wise and optimistic prefill exist to cut (derived)
    decode CPU  CPU seconds the path's decode scheduler used during the request

    PYTHONPATH=. .venv/bin/python scripts/bench_layerwise.py --rates 25mbit,200mbit --rtts-ms 0,50 \\
        --lengths 4096,7936 --reps 3          (root: namespaces, TUN, tc)
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import statistics
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path

import psutil

from prfaas_sgl.tools import link_delay, netns
from prfaas_sgl.tools.launch import SGLangServer, ServerSpec, free_port, stop_together
from prfaas_sgl.tools.models.tiny import ensure
from tests.sglang.pd import generate_body
from tests.sglang.prompts import prompt_ids

ZMQ = ("--prfaas-zmq-insecure", "--prfaas-zmq-timeout-s", "300")
NO_CACHE = ("--disable-radix-cache",)  # every prompt is computed in full: a prefix hit would hide the compute
PATHS = ("chunk", "layerwise", "optimistic", "mooncake")
DECODE_OF = {"chunk": "decode", "layerwise": "decode", "optimistic": "decode", "mooncake": "mooncake_decode"}


def servers(model: str, link: netns.Link, chunk: int, group: int, log_dir: Path) -> dict[str, SGLangServer]:
    path = str(ensure(model))

    def prefill(name: str, backend: str, extra: tuple[str, ...]) -> ServerSpec:
        return ServerSpec(path, free_port(), host=link.remote_ip, mode="prefill", transfer_backend=backend,
                          bootstrap_port=free_port(), chunked_prefill_size=chunk, netns=link.netns,
                          extra_args=NO_CACHE + extra, log_path=str(log_dir / f"prefill_{name}.log"))

    def decode(name: str, backend: str, extra: tuple[str, ...]) -> ServerSpec:
        return ServerSpec(path, free_port(), host=link.local_ip, mode="decode", transfer_backend=backend,
                          max_running_requests=1, extra_args=extra, log_path=str(log_dir / f"{name}.log"))

    specs = {
        "chunk": prefill("chunk", "prfaas_zmq", ZMQ),
        "layerwise": prefill("layerwise", "prfaas_zmq", ZMQ + ("--prfaas-layerwise-layers-per-group", str(group),
                                                               "--prfaas-layerwise-min-tokens", "1")),
        "optimistic": prefill("optimistic", "prfaas_zmq", ZMQ + ("--optimistic-prefill-attempts", "1")),
        "mooncake": prefill("mooncake", "mooncake", ()),
        "decode": decode("decode", "prfaas_zmq", ZMQ),
        "mooncake_decode": decode("mooncake_decode", "mooncake", ()),
        "colocated": ServerSpec(path, free_port(), chunked_prefill_size=chunk, extra_args=NO_CACHE,
                                log_path=str(log_dir / "colocated.log")),
    }
    return {name: SGLangServer(s) for name, s in specs.items()}


def set_rate(link: netns.Link, rate: str) -> None:
    tbf = ["root", "tbf", "rate", rate, "burst", netns.BURST, "latency", "50ms"]
    subprocess.run(["tc", "qdisc", "change", "dev", link.local_dev, *tbf], check=True)
    subprocess.run([*link.exec_prefix, "tc", "qdisc", "change", "dev", link.remote_dev, *tbf], check=True)


def connect(url: str) -> http.client.HTTPConnection:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    conn.connect()
    return conn


def post_on(conn: http.client.HTTPConnection, body: dict) -> dict:
    try:
        conn.request("POST", "/generate", json.dumps(body), {"content-type": "application/json"})
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def timed_colocated(srv: SGLangServer, body: dict) -> tuple[float, dict]:
    conn = connect(srv.url)
    start = time.perf_counter()
    out = post_on(conn, body)
    return time.perf_counter() - start, out


def timed_pd(prefill: SGLangServer, decode: SGLangServer, body: dict) -> tuple[float, dict]:
    """Posts to both at once, as SGLang's PD protocol and a router do; the time is the decode's answer."""
    pd_body = {**body, "bootstrap_host": prefill.spec.host, "bootstrap_port": prefill.spec.bootstrap_port,
               "bootstrap_room": random.getrandbits(63)}
    pc, dc = connect(prefill.url), connect(decode.url)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(prefill=post_on(pc, pd_body)))
    start = time.perf_counter()
    t.start()
    result = post_on(dc, pd_body)
    elapsed = time.perf_counter() - start
    t.join(300)
    return elapsed, {**result, "prefill": out.get("prefill")}


def scheduler_of(server: SGLangServer) -> psutil.Process:
    return next(c for c in psutil.Process(server.proc.pid).children(recursive=True)
                if "scheduler" in " ".join(c.cmdline()))


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def one_round(srv: dict, paths: tuple[str, ...], model_path: str, length: int, seed: int) -> dict[str, float]:
    """TTFT of one fresh prompt on the colocated server and through each path, in a seeded random order."""
    body = generate_body(prompt_ids(model_path, length, seed=seed), 1)
    row = {}
    row["colocated"], ref = timed_colocated(srv["colocated"], body)
    for name in random.Random(seed).sample(list(paths), len(paths)):
        decode = srv[DECODE_OF[name]]
        sched = scheduler_of(decode)
        cpu0 = cpu_s(sched)
        row[name], out = timed_pd(srv[name], decode, body)
        row[f"decode_cpu_{name}"] = cpu_s(sched) - cpu0
        if out.get("output_ids") != ref.get("output_ids"):
            raise RuntimeError(f"{name} at {length} tokens: {out} != colocated {ref.get('output_ids')}")
    return row


def summarize(rows: list[dict[str, float]], paths: tuple[str, ...]) -> dict:
    out = {"ttft_colocated_s": statistics.median(r["colocated"] for r in rows)}
    for name in paths:
        out[f"ttft_{name}_s"] = statistics.median(r[name] for r in rows)
        out[f"tail_{name}_s"] = statistics.median(r[name] - r["colocated"] for r in rows)
        out[f"decode_cpu_{name}_s"] = statistics.median(r[f"decode_cpu_{name}"] for r in rows)
    return out


def optimistic_batches(srv: dict) -> dict[str, int]:
    """From the optimistic prefill's log (SGLang counts requests started ahead of their decode only in its
    batch log line): how many of its prefill batches held such a request."""
    counts = [int(m) for m in re.findall(r"#optimistic-req: (\d+)", srv["optimistic"].log_path.read_text())]
    return {"prefill_batches": len(counts), "batches_with_optimistic_req": sum(c > 0 for c in counts)}


def run(args, srv: dict, dl: link_delay.DelayedLink, model_path: str, results: dict) -> list[dict]:
    """Every row into ``results["rows"]``, written to --out as it comes (a run cut short keeps its rows)."""
    paths = tuple(args.paths.split(","))
    rows = results.setdefault("rows", [])
    for r, rate in enumerate(args.rates.split(",")):
        set_rate(dl.link, rate)
        for rtt in map(float, args.rtts_ms.split(",")):
            dl.set_delay(rtt / 2)
            for length in map(int, args.lengths.split(",")):
                before = optimistic_batches(srv) if "optimistic" in paths else {}
                raw = [one_round(srv, paths, model_path, length, seed=100_000 * r + 1000 * length + k)
                       for k in range(args.reps)]
                row = {"rate": rate, "rtt_ms": rtt, "tokens": length, "reps": args.reps,
                       "load": os.getloadavg(), **summarize(raw, paths), "raw": raw}
                if before:
                    row["optimistic_batches"] = {k: v - before[k] for k, v in optimistic_batches(srv).items()}
                print(json.dumps({k: v for k, v in row.items() if k != "raw"}), flush=True)
                rows.append(row)
                write(args.out, results)
    return rows


def write(out: str, results: dict) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--rates", default="25mbit,200mbit")
    ap.add_argument("--rtts-ms", default="0,50", help="round-trip delays added by the delay line")
    ap.add_argument("--lengths", default="4096,7936", help="tokens; the tiny models hold 8,192 positions")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"PD paths measured, of {','.join(PATHS)}")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--layers-per-group", type=int, default=1)
    ap.add_argument("--out", default="out/bench_layerwise.json")
    ap.add_argument("--log-dir", default="out/bench_layerwise_logs")
    args = ap.parse_args()
    problem = netns.root_problem()
    if problem:
        raise SystemExit(f"bench_layerwise: {problem}")
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    model_path = str(ensure(args.model))
    results = {"model": args.model, "chunk": args.chunk, "layers_per_group": args.layers_per_group,
               "link": f"tools/link_delay: TUN + tc tbf (burst {netns.BURST}, latency 50ms) + userspace delay line, "
                       f"MTU {link_delay.MTU}", "rtt_emulated": True, "load_before": os.getloadavg()}
    with link_delay.delayed_link(args.rates.split(",")[0]) as dl:
        srv = servers(args.model, dl.link, args.chunk, args.layers_per_group, log_dir)
        try:
            for s in srv.values():
                s.start()
            for s in srv.values():
                s.wait_healthy(timeout_s=600)
            one_round(srv, tuple(args.paths.split(",")), model_path, 256, seed=1)  # warm-up, not in the table
            run(args, srv, dl, model_path, results)
        finally:
            stop_together(list(srv.values()))
    results["load_after"] = os.getloadavg()
    write(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
